"""model.kernels=liger (rolemrc.models.kernels): parity with the default path where liger-kernel and
a CUDA device are present; everywhere, the switch is refused with a one-line reason when it cannot
work, and the default run never imports liger_kernel."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rolemrc.models.kernels import check_kernels, liger_available
from rolemrc.objectives import IGNORE_INDEX, sequence_logprobs
from tests.conftest import compose_train

needs_liger = pytest.mark.skipif(
    not liger_available(),
    reason="liger-kernel parity needs liger-kernel installed and a CUDA device "
           f"(liger_kernel importable: {__import__('importlib').util.find_spec('liger_kernel') is not None}, "
           f"CUDA: {torch.cuda.is_available()})",
)


def test_unknown_kernels_name_is_refused() -> None:
    with pytest.raises(ValueError, match=r"model.kernels='fast': expected one of none, liger"):
        check_kernels("fast")


@pytest.mark.skipif(liger_available(), reason="liger-kernel and a GPU are present: the switch works here")
def test_liger_switch_refused_where_it_cannot_run() -> None:
    from rolemrc.models.loading import check_model_cfg

    cfg = compose_train(["model.kernels=liger"])  # the key composes (ModelConfig schema) ...
    with pytest.raises(ValueError, match=r"model.kernels=liger needs (liger-kernel|a CUDA device)"):
        check_model_cfg(cfg.model)  # ... and is refused before anything loads


def test_default_run_does_not_import_liger() -> None:
    code = ("import sys; from rolemrc.models.loading import load_model, load_tokenizer; "
            "from rolemrc.models import logprob_head, kernels; print('liger_kernel' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@needs_liger
@pytest.mark.parametrize("packed", [False, True])
def test_fused_linear_logprobs_match_chunked(packed: bool) -> None:
    from rolemrc.models.kernels import liger_sequence_logprobs

    torch.manual_seed(0)
    dev = "cuda"
    hidden = torch.randn(2, 64, 32, device=dev, dtype=torch.float32, requires_grad=True)
    weight = (torch.randn(300, 32, device=dev) * 0.1).requires_grad_()
    labels = torch.randint(0, 300, (2, 64), device=dev)
    labels[:, :20] = IGNORE_INDEX
    ids = None
    if packed:
        ids = torch.zeros(2, 64, dtype=torch.long, device=dev)
        ids[0, 32:] = 1
        ids[1] = 2
        ids[1, 60:] = -1
    ref = sequence_logprobs(hidden, weight, labels, ids)
    got = liger_sequence_logprobs(hidden, weight, labels, ids)
    torch.testing.assert_close(got.logps, ref.logps, rtol=1e-4, atol=1e-3)
    assert torch.equal(got.num_tokens, ref.num_tokens)
    g_ref = torch.autograd.grad(ref.logps.sum(), (hidden, weight))
    g_got = torch.autograd.grad(got.logps.sum(), (hidden, weight))
    for a, b in zip(g_got, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


@needs_liger
@pytest.mark.parametrize("model", ["tiny", "tiny_qwen"])
def test_liger_model_logprobs_match_default(model: str) -> None:
    """A tiny Llama / Qwen2 with Liger's RMSNorm/RoPE/SwiGLU + fused loss gives the default path's
    per-sequence log-probs (fp32 on the GPU)."""
    from rolemrc.models.loading import decoder_and_head, load_model, load_tokenizer
    from rolemrc.objectives import shift_labels

    out = {}
    for kernels in ("none", "liger"):
        cfg = compose_train([f"model={model}", f"model.kernels={kernels}"])
        tok = load_tokenizer(cfg.model)
        torch.manual_seed(0)
        net = load_model(cfg.model, tok).cuda()
        decoder, head = decoder_and_head(net)
        torch.manual_seed(1)
        ids = torch.randint(5, len(tok), (2, 48), device="cuda")
        labels = shift_labels(ids.masked_fill(torch.arange(48, device="cuda") < 16, IGNORE_INDEX))
        hidden = decoder(input_ids=ids).last_hidden_state
        out[kernels] = head(hidden, labels).logps.detach()
    torch.testing.assert_close(out["liger"], out["none"], rtol=1e-4, atol=1e-3)
