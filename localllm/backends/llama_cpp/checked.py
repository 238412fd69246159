"""The llama.cpp backend as the registry hands it out: the backend with its load check.

The check is the load probe (probe.py) and its flash attention trial (flash_trial.py). Both load weights through
the plain backend in a child process, so the check sits above backend.py rather than in it."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from pathlib import Path

from ...api import LoadOptions, LoraAdapter
from ..base import LoadCheck
from .backend import LlamaCppBackend
from .probe import LoadProbe, start_trial


class CheckedLlamaCppBackend(LlamaCppBackend):
    def check(
        self, path: Path, options: LoadOptions, *, memory: Path, adapters: Sequence[LoraAdapter] = ()
    ) -> LoadCheck:
        """A file (or a file with adapters) that aborts llama.cpp fails here, in the probe's child, once per file (or
        pair) and llama.cpp version."""
        probed = LoadProbe(memory).check(path, options, adapters=adapters)
        then = partial(start_trial, memory, path, options) if probed.trial_due else None
        return LoadCheck(flash_attn=probed.flash_attn_for(options), then=then)
