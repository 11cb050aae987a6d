"""The ranks of a run and the process that follows them.

Every rank, whatever runs it, runs one session (``worker``): build the trainer, restore and turn
away from later steps on resume, train, record how it ended. A run of world size 1 runs that session
in the ``rlctl`` process itself. Several ranks run as local processes (``local``, ``rlctl start
--nproc N``) or as Ray actors placed by a placement group (``ray``, ``cluster.backend: ray``), the
ranks forming one torch.distributed group for DeepSpeed (gloo on CPU, NCCL on CUDA, HCCL on NPU).
Rank 0 writes the run's metrics and events and commits snapshots once every rank's files are in.
One supervisor (``supervise``) follows the ranks of either kind through a small handle protocol:
it shows progress from rank 0's metrics, forwards SIGTERM/SIGUSR1 to every rank, stops the others
when one fails, and returns rank 0's outcome (or the first failing rank's). Under Ray, ``nodes``
says when a rank's node is lost (Ray declares it dead, or its actor stops answering pings): the
supervisor then ends the other ranks at once and the run exits 76. ``stops`` installs and restores
the stop signals for all of them; ``report`` is how a session shows progress.
"""
