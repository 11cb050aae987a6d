"""Snapshots on fsspec storage: ``layout`` names every file of one; ``catalog`` reads them (scan,
candidates, best, quarantine) and needs nothing that writes; ``retention`` rules which to keep; the
manager (``snapshots``) saves, commits, purges and restores them, its files written by the writer
(``staging``, ``job``, ``durable``, ``handover``, ``writer``). Knows Stateful objects (rlctl.stateful), never models:
never imports rlctl.engine."""
