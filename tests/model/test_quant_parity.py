"""The engine computes what llama.cpp computes on files in the types people download: tiny models
that llama.cpp's own quantiser made (Q4_1, Q5_0, Q5_1, Q2_K, Q3_K_M, IQ4_NL, IQ3_S, MXFP4_MOE;
Q2_K and Q3_K_M mix types within a layer: gate and up in one, down in another) and one whose
experts are written as IQ3_XXS blocks directly (random valid grid indices and signs, small finite
scales; the other matrices Q8_0), which llama.cpp loads.

As in test_engine_parity: within 1e-4 of the independent fp32 reference (reference.py, checked
against llama.cpp on the F32 files), and top-1 agreement with llama.cpp of at least 97%, here over
32 positions of the Qwen3-MoE tiny model. llama.cpp's own products round its activations to 8
bits for these types, so its logits differ from the exact ones by a few percent of their scale;
the numbers are printed (``pytest -s``).
"""

from __future__ import annotations

import gguf
import pytest
from reference import RefModel, relative_error, top1_agreement
from test_engine_parity import engine, llama_cpp_logits

from strata.engine.quant import SUPPORTED_TYPES

Q = gguf.GGMLQuantizationType
KINDS = ("Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_M", "IQ4_NL", "IQ3_S", "MXFP4_MOE", "IQ3_XXS")
POSITIONS = 32


@pytest.mark.parametrize("kind", KINDS)
def test_files_of_the_new_types_match_reference_and_llama_cpp(
    kind: str, tiny_models, llama_cpp_ref
) -> None:
    arch = "qwen3moe"
    path = tiny_models.path("qwen3moe", kind)
    types = {t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types <= SUPPORTED_TYPES
    ref = RefModel(path)
    tokens = ref.test_sequence(POSITIONS)
    ours = engine(path).sequences.logits_all(tokens).double().numpy()
    rel_ref = relative_error(ours, ref.forward(tokens))
    theirs = llama_cpp_logits(llama_cpp_ref(path), tokens)
    top1 = top1_agreement(ours, theirs)
    print(
        f"\n{arch} {kind} ({', '.join(sorted(t.name for t in types))}): rel error vs reference"
        f" {rel_ref:.3g}; vs llama.cpp {relative_error(ours, theirs):.3g}, top-1 {top1:.1%}"
    )
    assert rel_ref < 1e-4
    assert top1 >= 0.97
