"""The built-in demo model: what ``strata serve`` runs when no model is configured.

A small qwen3moe file with *random weights* (its text is meaningless) and a real byte-level BPE
vocabulary with a Qwen3-style chat template that renders tools (``vocab.QWEN3_TEMPLATE``), written
with the ``gguf`` package in well under a second and reused from the cache directory afterwards.
Large enough to exercise routing (16 experts, top-4, in every layer), small enough to decode tens
of tokens per second on a 2-core CPU.

Its greedy answer never ends early: ``synth`` shrinks the output rows of every control token
(end-of-text, ``<|im_end|>``, ``<|im_start|>``) to ~1e-3 of the others, so their logits sit near
0 while the best random token is several sigma above, and the model follows a bigram cycle that
runs through every ordinary token of the vocabulary instead.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from strata.engine import synth
from strata.engine.vocab import QWEN3_TEMPLATE

log = logging.getLogger(__name__)

DEMO_PRESET = "demo"
DEMO_SEED = 7
DEMO_STEM = "strata-demo"


def ensure_demo_model(cache_dir: str | os.PathLike[str]) -> Path:
    """The demo model's path under ``cache_dir``, writing it first if it is not there yet.

    The file name carries the generator version and a digest of everything that decides its
    bytes, and it is written to a temporary file and renamed, so a reader never sees half a file
    and a newer Strata never reuses an older demo.
    """
    spec = synth.PRESETS[DEMO_PRESET]
    vocab = dataclasses.replace(synth.vocab_for(spec.arch), chat_template=QWEN3_TEMPLATE)
    types = synth.PRESET_TYPES[DEMO_PRESET]
    path = synth.ensure_model(cache_dir, DEMO_STEM, spec, vocab, types, DEMO_SEED)
    log.info("demo model (random weights, meaningless text): %s", path)
    return path
