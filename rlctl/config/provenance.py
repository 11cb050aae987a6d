"""Where a config was read, kept beside its values: a check made after validation (the preflight's look
at the files and storage a config names) speaks the sentence the config's own validation would, with
the same lead (``invalid config``; ``RUN/config.yaml: invalid config`` for a run's saved config) and
the file and line, or the --set flag, where the key was written."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlctl.errors import ConfigError
from rlctl.yamlsrc import Origins, origin_for

Problem = tuple[tuple[str, ...], str]  # (the key path, what is wrong with its value)


@dataclass(frozen=True, eq=False)
class Provenance:
    lead: str = "invalid config"
    origins: Origins = field(default_factory=dict)

    def __eq__(self, other: object) -> bool:  # where a config was read is no part of its value
        return isinstance(other, Provenance)

    def __hash__(self) -> int:
        return 0

    def error(self, problems: list[Problem]) -> ConfigError:
        """One ConfigError for ``problems``, in the words of a validation error: ``LEAD: 'KEY' (ORIGIN):
        PROBLEM; ...``, ended by a full stop unless it asks a question."""
        sentences = [
            f"'{'.'.join(key) or '(top level)'}'{origin_for(key, self.origins)}: {what}" for key, what in problems
        ]
        text = f"{self.lead}: " + "; ".join(sentences)
        return ConfigError(text if text.endswith(("?", ".")) else text + ".")
