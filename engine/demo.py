"""The built-in demo model: what ``strata serve`` runs when no model is configured.

A small qwen3moe file with *random weights* (its text is meaningless) and a real byte-level BPE
vocabulary with a Qwen3-style chat template that renders tools (``vocab.QWEN3_TEMPLATE``), written
with the ``gguf`` package in well under a second and reused from the cache directory afterwards.
Large enough to exercise routing (16 experts, top-4, in every layer), small enough to decode tens
of tokens per second on a 2-core CPU.

**Its answers end.** ``synth`` makes each output row echo the embedding of the token it follows
(a bigram prior that wins by several logits, so greedy text is deterministic and survives
rounding); the demo replaces synth's one endless cycle through the vocabulary by a tree whose
root is followed by ``<|im_end|>`` (:func:`answer_plan`):

* the **trunk**: the last ``TRUNK`` tokens before the end are non-ASCII tokens (whole
  characters), in one chain, so an answer to a prompt that ends in an ASCII token (every chat
  prompt ends in ``assistant\\n``) runs at least ``TRUNK`` tokens before it ends;
* above it every other token, in chains of ``BRANCH`` tokens that meet ``FAN_IN`` at a time,
  so no path to the end is longer than a few hundred tokens (``MAX_ANSWER``, checked when the
  plan is made). Tokens that are only a piece of a character are the leaves: no token leads to
  them, so greedy text never breaks a character.

A token that follows several (a meeting point) echoes each of them: the noise that adds to its
logit elsewhere is ~sqrt(FAN_IN / n_embd) of the echo's gain, far below the winner's margin. The
other control tokens keep their muted rows (~1e-3 of the others), so they never appear.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import zlib
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from strata.engine import synth
from strata.engine.vocab import QWEN3_TEMPLATE

if TYPE_CHECKING:
    from strata.engine.vocab import Vocab

log = logging.getLogger(__name__)

DEMO_PRESET = "demo"
DEMO_SEED = 7
DEMO_STEM = "strata-demo"
TRUNK = 96  # the least an answer to a prompt ending in an ASCII token runs
BRANCH = 12  # tokens between two meeting points above the trunk
FAN_IN = 4  # chains that meet at one token
MAX_ANSWER = 400  # the most any answer runs before its end token (the plan is checked)
PLAN = f"answers-end-v2-{TRUNK}-{BRANCH}-{FAN_IN}"  # in the file's content key


def ensure_demo_model(cache_dir: str | os.PathLike[str]) -> Path:
    """The demo model's path under ``cache_dir``, writing it first if it is not there yet.

    The file name carries the generator version and a digest of everything that decides its
    bytes, and it is written to a temporary file and renamed, so a reader never sees half a file
    and a newer Strata never reuses an older demo.
    """
    spec = synth.PRESETS[DEMO_PRESET]
    vocab = dataclasses.replace(synth.vocab_for(spec.arch), chat_template=QWEN3_TEMPLATE)
    types = synth.PRESET_TYPES[DEMO_PRESET]
    path = synth.ensure_model(
        cache_dir, DEMO_STEM, spec, vocab, types, DEMO_SEED, successors=(PLAN, answer_plan)
    )
    log.info("demo model (random weights, meaningless text): %s", path)
    return path


def answer_plan(vocab: Vocab, muted: np.ndarray, seed: int) -> np.ndarray:
    """pred: [V, FAN_IN], the tokens each token follows (-1: none): every speakable token
    follows exactly one other, along a tree whose root ``<|im_end|>`` follows (module doc)."""
    end = vocab.eos_id
    if end is None:
        raise ValueError("the demo's vocabulary has no end token for its answers to end with")
    n_vocab = len(vocab.tokens)
    silent = set(muted.tolist()) | {end}
    speakable = [i for i in range(n_vocab) if i not in silent]
    rng = np.random.default_rng([seed, zlib.crc32(b"strata.demo.answers")])
    kinds = {i: _kind(synth.token_bytes(vocab, i)) for i in speakable}
    rare = [i for i in speakable if kinds[i] == "utf-8"]
    if len(rare) < TRUNK:
        raise ValueError(f"the demo's vocabulary has {len(rare)} non-ASCII tokens, {TRUNK} needed")
    trunk = [rare[j] for j in rng.permutation(len(rare))][:TRUNK]
    rest = sorted(set(speakable) - set(trunk))
    # pieces of characters (a lone byte of a UTF-8 sequence) last: they become the leaves,
    # which no token leads to, so a greedy answer never shows a broken character
    pieces = [i for i in rest if kinds[i] == "piece"]
    whole = [i for i in rest if kinds[i] != "piece"]
    pred = np.full((n_vocab, FAN_IN), -1, dtype=np.int64)
    depth = np.zeros(n_vocab, dtype=np.int64)  # how many tokens an answer from here runs
    before = end
    for token in trunk:  # end <- trunk[0] <- trunk[1] <- ...
        pred[before, 0] = token
        depth[token] = depth[before] + 1 if before != end else 1
        before = token
    pool = [whole[j] for j in rng.permutation(len(whole))]  # taken from the end
    placed: list[int] = []  # the tree's tokens in the order they were placed
    open_ = deque([(trunk[-1], 0)])  # (token, tokens since the last meeting point)
    while pool:
        node, run = open_.popleft()
        meets = run == BRANCH - 1
        for slot in range(FAN_IN if meets else 1):
            if not pool:
                break
            token = pool.pop()
            pred[node, slot] = token
            depth[token] = depth[node] + 1
            placed.append(token)
            open_.append((token, 0 if meets else run + 1))
    # each piece before one of the last placed tokens (a second predecessor at most): a leaf
    hosts = [t for t in reversed(placed) if pred[t, -1] < 0]
    if len(hosts) < len(pieces):
        raise ValueError(f"the demo's answer plan has {len(hosts)} places for {len(pieces)} pieces")
    for token, host in zip(pieces, hosts, strict=False):
        pred[host, int((pred[host] >= 0).sum())] = token
        depth[token] = depth[host] + 1
    longest = int(depth.max())
    if longest > MAX_ANSWER:
        raise ValueError(f"the demo's answer plan runs {longest} tokens, more than {MAX_ANSWER}")
    return pred


def _kind(data: bytes) -> str:
    """``ascii``, ``utf-8`` (whole characters beyond ASCII) or ``piece`` (not valid alone)."""
    if all(byte < 0x80 for byte in data):
        return "ascii"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return "piece"
    return "utf-8"
