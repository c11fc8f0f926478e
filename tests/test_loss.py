"""The fused LM head + cross-entropy (fitone.loss) against each architecture's own loss, on users' tiny models.

The bounds are those of the arithmetic: the chunked path computes the same logits (a matmul over the hidden
size H, whose rounding may fall differently when the rows come in other groups), the same fp32 softmax and
the same cast of its gradient, and the gradients' matmuls over V (for the hidden states) and the tokens (for
the head's weight). The standard bound of a dot product of length n, n x eps x sum|a_i b_i|, is applied to
each, with the softmax's error at most twice its input's.
"""

from __future__ import annotations

import pytest
import torch

import user_models
from fitone import loss as fused
from tolerance import EPS

CAUSAL = list(user_models.CAUSAL)


def _model(arch: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = user_models.model_config(arch, vocab_size=320)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.config.use_cache = False
    return model.train()


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, vocab, (3, 12), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt that is not trained on
    labels[2, 9:] = -100  # padding
    mask = torch.ones_like(ids)
    mask[2, 9:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _loss_and_grads(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(2)  # dropout, where a model has it, draws the same masks in both runs
    model.zero_grad(set_to_none=True)
    out = model(**batch).loss
    out.backward()
    return out.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _head_bound(model, batch, precision: str) -> float:
    """The logits' rounding bound, H x eps x max over tokens and vocabulary of sum_i |h_i w_i|, doubled for
    the softmax, which moves the loss by at most that (the log-sum-exp and the target logit each move by the
    logits' error)."""
    with torch.no_grad():
        hidden = model(**{k: v for k, v in batch.items() if k != "labels"}, output_hidden_states=True).hidden_states[-1]
        w = model.get_output_embeddings().weight
        dot = (hidden.abs().float() @ w.abs().float().t()).max()
    return 2 * float(dot) * hidden.shape[-1] * EPS[precision]


@pytest.mark.parametrize("arch", CAUSAL)
def test_the_chunked_loss_and_its_gradients_are_each_architectures_own(arch, monkeypatch):
    model = _model(arch)
    batch = _batch(model.config.vocab_size)
    want_loss, want = _loss_and_grads(model, batch)
    backend = fused.fused_loss_backend(model.config, device="cpu", precision="fp32")
    assert backend == "chunked"
    monkeypatch.setattr(fused, "CHUNK_ELEMENTS", 7 * model.config.vocab_size)  # 7 tokens a chunk: several chunks
    fused.install(model, backend)
    got_loss, got = _loss_and_grads(model, batch)
    bound = _head_bound(model, batch, "fp32") + 2 * 36 * EPS["fp32"] * float(want_loss)  # + the sums over tokens
    assert abs(float(got_loss) - float(want_loss)) <= bound, (float(got_loss), float(want_loss), bound)
    assert set(got) == set(want)
    # every gradient descends from the hidden states' and the head's gradients through the same backward, so
    # its rounding is that of the longest sums (V for the hidden states, the tokens for the head) relative to
    # the terms summed, which are of the size of the model's largest gradients (a gradient that cancels to
    # about zero, as a key bias's does, keeps the rounding of its terms)
    n = model.config.vocab_size + 36
    scale = max(float(g.abs().max()) for g in want.values())
    for name, g in got.items():
        diff = float((g - want[name]).abs().max())
        assert diff <= 4 * n * EPS["fp32"] * scale, (name, diff, scale)


def test_the_chunked_loss_matches_in_bf16_to_bf16_rounding(monkeypatch):
    model = _model("llama3", torch.bfloat16)
    batch = _batch(model.config.vocab_size)
    want_loss, want = _loss_and_grads(model, batch)
    monkeypatch.setattr(fused, "CHUNK_ELEMENTS", 5 * model.config.vocab_size)
    fused.install(model, "chunked")
    got_loss, got = _loss_and_grads(model, batch)
    # the bf16 logits round in both paths; the head's gradient sums 8 chunk products, each rounded to bf16
    # (the plain path rounds one product): up to one bf16 step of the gradient per chunk, through the backward
    chunks = -(-36 // 5)
    assert abs(float(got_loss) - float(want_loss)) <= _head_bound(model, batch, "bf16"), (got_loss, want_loss)
    for name, g in got.items():
        tol = (chunks + 2) * 8 * EPS["bf16"] * float(want[name].float().abs().max()) + 1e-30
        diff = float((g.float() - want[name].float()).abs().max())
        assert diff <= tol, (name, diff, tol)


def test_the_fp16_loss_scale_reaches_the_gradient_before_its_cast():
    """The fp16 loss scale multiplies the logits' gradient before it is cast to 16 bits, as in the plain loss:
    gradients below fp16's smallest subnormal at scale 1 survive at scale 2^16, as the plain loss's do."""
    torch.manual_seed(0)
    hidden = torch.randn(4096, 16).half().requires_grad_()
    weight = (torch.randn(50, 16) * 1e-4).half().requires_grad_()
    labels = torch.randint(0, 50, (4096,))
    scale = 2.0**16
    (fused.linear_cross_entropy(hidden, weight, labels) * scale).backward()
    got = hidden.grad.float()
    hidden.grad = None
    (torch.nn.functional.cross_entropy((hidden @ weight.t()).float(), labels) * scale).backward()
    want = hidden.grad.float()
    assert float(want.abs().min()) * 2**-16 < 2**-24  # at scale 1 these would round to zero in fp16
    assert int((got == 0).sum()) == int((want == 0).sum()) == 0
    # both cast the same fp32 gradient of the logits to fp16 (at most one fp16 step apart where their softmaxes
    # round differently), then sum 50 products: 50 + 2 fp16 steps of the summed magnitudes
    tol = 52 * torch.finfo(torch.float16).eps * (hidden.grad.float().abs() + 1e-3 * want.abs().max())
    assert bool(((got - want).abs() <= tol).all())


def test_evaluation_and_generation_keep_the_models_own_forward():
    model = _model("qwen3")
    batch = _batch(model.config.vocab_size)
    fused.install(model, "chunked")
    model.eval()
    with torch.no_grad():
        out = model(**batch)
    assert out.logits.shape == (3, 12, model.config.vocab_size)
    assert out.loss is not None


def test_architectures_whose_loss_is_not_plain_keep_their_forward():
    config = user_models.model_config("mixtral", vocab_size=320)
    config.output_router_logits = True  # the router's auxiliary loss is added to the LM loss
    assert fused.fused_loss_backend(config, device="cpu", precision="bf16") is None
    assert fused.fused_loss_backend(user_models.model_config("t5-v1_1", 320), device="cpu", precision="bf16") is None
    # liger needs a CUDA GPU and never takes fp16 (its gradients are formed at loss scale 1)
    llama = user_models.model_config("llama3", 320)
    llama.vocab_size = fused.FUSED_MIN_VOCAB_GPU  # a large vocabulary: the config is only read, never built
    assert fused.fused_loss_backend(llama, device="cuda", precision="fp16") == "chunked"
    assert fused.fused_loss_backend(llama, device="cpu", precision="bf16") == "chunked"


def test_a_small_vocabulary_keeps_the_models_own_loss_on_a_gpu_only():
    """On a GPU, under FUSED_MIN_VOCAB_GPU tokens the logits are small and the fused kernel was no faster
    (bench/results/2026-12-02b-gpu/): the model's own loss. On a CPU the chunked path stays (tested above)."""
    llama = user_models.model_config("llama3", 320)
    for vocab, want in ((fused.FUSED_MIN_VOCAB_GPU - 1, None), (fused.FUSED_MIN_VOCAB_GPU, "chunked")):
        llama.vocab_size = vocab
        assert fused.fused_loss_backend(llama, device="cuda", precision="fp16") == want
        assert fused.fused_loss_backend(llama, device="cpu", precision="fp16") == "chunked"


@pytest.mark.parametrize("arch,bos", [("llama3", True), ("qwen2", False)])
def test_a_users_model_trains_with_the_fused_loss_as_with_its_own(arch, bos, tmp_path, text_jsonl, capfd):
    """Real ZeRO-2 engines on a user's model directory: the fused loss's run follows the model's own loss's
    step by step over the first steps (fp32, where the two differ only by rounding) and the loss falls."""
    import fitone
    from conftest import cpu_config
    from tolerance import LINEAR_STEPS, fp32_loss_drift

    path = user_models.model_dir(arch, tmp_path / arch, bos=bos)
    runs = {}
    for fused_on in (True, False):
        runs[fused_on] = fitone.train(cpu_config(model=str(path), from_scratch=False, data=str(text_jsonl),
                                                 seq_len=32, batch_size=4, lr=1e-3, max_steps=LINEAR_STEPS,
                                                 fused_loss=fused_on))
        said = capfd.readouterr()
        assert ("LM head and cross-entropy fused (chunked" in said.out + said.err) == fused_on
    got, want = runs[True].losses, runs[False].losses
    depth = 2 * 7 + 1  # two decoder layers of seven weight matrices, then the head
    for step, (g, w) in enumerate(zip(got, want), 1):
        assert abs(g - w) <= fp32_loss_drift(w, step, depth), (step, g, w)
    assert got[-1] < got[0]
