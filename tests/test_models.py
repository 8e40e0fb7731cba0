"""Unit tests of the model registry and the three models: shapes, sizes, determinism,
causality, initialisation, and the properties the parallel techniques rely on (no shared
tensors, every parameter used, a GPT that splits into pipeline stages). No process group."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.data.sources import TaskSpec
from scaletrain.models import _REGISTRY, MODEL_NAMES, MODEL_SIZES, build_model, count_parameters
from scaletrain.models.gpt import GPT_SHAPES

MNIST = TaskSpec("classification", (1, 28, 28), 10)
DIGITS = TaskSpec("classification", (1, 8, 8), 10)
ODD_IMAGES = TaskSpec("classification", (3, 9, 13), 7)  # channels, odd sides, 7 classes
TEXT = TaskSpec("lm", (32,), 256)
CASES = [
    ("mlp", MNIST),
    ("mlp", DIGITS),
    ("mlp", ODD_IMAGES),
    ("cnn", MNIST),
    ("cnn", DIGITS),
    ("cnn", ODD_IMAGES),
    ("gpt", TEXT),
]


def _inputs(task: TaskSpec, batch: int = 3) -> torch.Tensor:
    if task.kind == "lm":
        return torch.randint(0, task.num_classes, (batch, *task.input_shape))  # (B, T)
    return torch.randn(batch, *task.input_shape)  # (B, C, H, W)


def test_registry_lists_every_model():
    assert set(_REGISTRY) == set(MODEL_NAMES)


@pytest.mark.parametrize("size", MODEL_SIZES)
@pytest.mark.parametrize("name,task", CASES)
def test_forward_shape(name, task, size):
    torch.manual_seed(0)
    model = build_model(name, size=size, task=task)
    logits = model(_inputs(task))
    expected = (
        (3, task.input_shape[0], task.num_classes) if task.kind == "lm" else (3, task.num_classes)
    )
    assert logits.shape == expected
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_gpt_accepts_shorter_sequences_and_refuses_longer():
    model = build_model("gpt", size="tiny", task=TEXT)
    assert model(torch.randint(0, 256, (2, 5))).shape == (2, 5, 256)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.randint(0, 256, (2, 33)))


@pytest.mark.parametrize("name,task", CASES)
def test_same_seed_same_weights_and_outputs(name, task):
    def build(seed):
        torch.manual_seed(0)  # the global stream plays no part: the seed argument decides
        return build_model(name, size="small", task=task, seed=seed)

    a, b, c = build(1), build(1), build(2)
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key]), key
    assert any(not torch.equal(v, c.state_dict()[k]) for k, v in a.state_dict().items())
    x = _inputs(task)
    assert torch.equal(a(x), b(x))


@pytest.mark.parametrize("name,task", CASES)
def test_parameter_counts_grow_with_size(name, task):
    counts = [count_parameters(build_model(name, size=size, task=task)) for size in MODEL_SIZES]
    assert counts[0] < counts[1] < counts[2]


def test_parameter_counts_match_the_architecture():
    # MLP small on MNIST: 784 -> 256 -> 256 -> 10, weights and biases.
    mlp = 784 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
    assert count_parameters(build_model("mlp", size="small", task=MNIST)) == mlp == 269_322
    # CNN small: conv 1->32, conv 32->64, then a 4x4 grid for any image size: 1024 -> 64 -> 10.
    cnn = 32 * 9 + 32 + 64 * 32 * 9 + 64 + 64 * 16 * 64 + 64 + 64 * 10 + 10
    assert count_parameters(build_model("cnn", size="small", task=MNIST)) == cnn == 85_066
    assert count_parameters(build_model("cnn", size="small", task=DIGITS)) == cnn
    # GPT: embeddings, per block 2 LayerNorms + q,k,v,proj + fc,proj, final LayerNorm, untied head.
    for size, shape in GPT_SHAPES.items():
        C, L, V, T = shape.n_embd, shape.n_layer, 256, 32
        block = 2 * 2 * C + 4 * (C * C + C) + (C * 4 * C + 4 * C) + (4 * C * C + C)
        expected = V * C + T * C + L * block + 2 * C + C * V
        assert count_parameters(build_model("gpt", size=size, task=TEXT)) == expected, size


def test_count_parameters_counts_shared_tensors_once():
    shared = nn.Linear(4, 4)
    assert count_parameters(nn.Sequential(shared, shared)) == 20


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(name="resnet", size="small", task=MNIST), "mlp, cnn, gpt"),
        (dict(name="mlp", size="huge", task=MNIST), "tiny, small, base"),
        (dict(name="gpt", size="tiny", task=MNIST), "'lm'"),
        (dict(name="cnn", size="tiny", task=TEXT), "'classification'"),
        (dict(name="mlp", size="tiny", task=TEXT), "gpt"),  # names the models that do fit
        (dict(name="mlp", size="tiny", task=MNIST, dropout=1.0), "dropout"),
    ],
)
def test_bad_arguments_are_refused_with_the_allowed_values(kwargs, needle):
    name = kwargs.pop("name")
    with pytest.raises(ValueError) as info:
        build_model(name, **kwargs)
    assert needle in str(info.value)


def test_cnn_refuses_images_smaller_than_8x8():
    with pytest.raises(ValueError, match="8x8"):
        build_model("cnn", size="tiny", task=TaskSpec("classification", (1, 7, 28), 10))
    with pytest.raises(ValueError, match="8x8"):
        build_model("cnn", size="tiny", task=TaskSpec("classification", (28, 28), 10))


def test_gpt_is_causal():
    torch.manual_seed(0)
    model = build_model("gpt", size="tiny", task=TEXT).eval()
    x = torch.randint(0, 256, (2, 32))
    y = x.clone()
    y[:, 20] = (y[:, 20] + 1) % 256  # change one token
    a, b = model(x), model(y)
    assert torch.allclose(a[:, :20], b[:, :20], atol=1e-6)  # the past can't see it
    assert not torch.allclose(a[:, 20:], b[:, 20:], atol=1e-4)  # it and the future do


def _reference_gpt_forward(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """The GPT's forward written out with an explicit masked softmax, from its weights."""
    B, T = idx.shape
    x = model.tok_emb.weight[idx] + model.pos_emb.weight[:T]  # (B, T, C)
    causal = torch.ones(T, T, dtype=torch.bool).tril()  # (T, T) True where attending is allowed
    for block in model.blocks.values():
        a = block.attn
        h = F.layer_norm(x, x.shape[-1:], block.ln_1.weight, block.ln_1.bias)
        q, k, v = (  # 3 x (B, nh, T, hs)
            F.linear(h, m.weight, m.bias).view(B, T, -1, a.head_dim).transpose(1, 2)
            for m in (a.q, a.k, a.v)
        )
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(a.head_dim)  # (B, nh, T, T)
        y = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v  # (B, nh, T, hs)
        x = x + F.linear(y.transpose(1, 2).reshape(B, T, -1), a.proj.weight, a.proj.bias)
        h = F.layer_norm(x, x.shape[-1:], block.ln_2.weight, block.ln_2.bias)
        h = F.gelu(F.linear(h, block.mlp.fc.weight, block.mlp.fc.bias))  # (B, T, 4C)
        x = x + F.linear(h, block.mlp.proj.weight, block.mlp.proj.bias)
    x = F.layer_norm(x, x.shape[-1:], model.ln_f.weight, model.ln_f.bias)
    return x @ model.lm_head.weight.T  # (B, T, V)


def test_gpt_matches_a_reference_forward():
    torch.manual_seed(0)
    model = build_model("gpt", size="small", task=TEXT).eval()
    with torch.no_grad():  # perturb LayerNorms and biases away from their init so they count
        for name, param in model.named_parameters():
            if "ln" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    idx = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        assert torch.allclose(model(idx), _reference_gpt_forward(model, idx), atol=1e-5)


def test_gpt_initialisation_follows_nanogpt():
    torch.manual_seed(0)
    model = build_model("gpt", size="base", task=TEXT)
    L = GPT_SHAPES["base"].n_layer
    assert model.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.05)
    residual_std = pytest.approx(0.02 / math.sqrt(2 * L), rel=0.05)
    assert model.blocks["0"].mlp.proj.weight.std().item() == residual_std
    assert model.blocks["0"].attn.proj.weight.std().item() == residual_std
    assert torch.count_nonzero(model.blocks["0"].attn.q.bias) == 0


def test_gpt_starts_near_uniform_loss():
    torch.manual_seed(0)
    model = build_model("gpt", size="tiny", task=TEXT)
    x = torch.randint(0, 256, (4, 32))
    loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
    assert loss.item() == pytest.approx(math.log(256), abs=0.1)


def test_gpt_has_no_shared_tensors_and_saves_with_safetensors(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    model = build_model("gpt", size="tiny", task=TEXT)
    assert model.lm_head.weight.data_ptr() != model.tok_emb.weight.data_ptr()
    path = tmp_path / "gpt.safetensors"
    safetensors_torch.save_file(model.state_dict(), str(path))  # refuses shared storage
    loaded = safetensors_torch.load_file(str(path))
    assert all(torch.equal(v, loaded[k]) for k, v in model.state_dict().items())


def test_gpt_splits_into_pipeline_stages():
    torch.manual_seed(0)
    full = build_model("gpt", size="small", task=TEXT).eval()
    first, last = (
        build_model("gpt", size="small", task=TEXT),
        build_model("gpt", size="small", task=TEXT),
    )
    first.load_state_dict(full.state_dict())
    last.load_state_dict(full.state_dict())
    del first.blocks["2"], first.blocks["3"]
    first.lm_head = None
    del last.blocks["0"], last.blocks["1"]
    last.tok_emb = None
    x = torch.randint(0, 256, (2, 32))
    hidden = first.eval()(x)
    assert hidden.shape == (2, 32, GPT_SHAPES["small"].n_embd)
    assert torch.allclose(last.eval()(hidden), full(x), atol=1e-5)


@pytest.mark.parametrize("name,task", CASES)
def test_every_parameter_gets_a_gradient(name, task):
    # DDP refuses parameters unused in the forward unless told to search for them.
    model = build_model(name, size="tiny", task=task)
    model(_inputs(task)).square().mean().backward()
    missing = [
        n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0
    ]
    assert not missing


@pytest.mark.parametrize("name,task", CASES)
def test_dropout_acts_in_training_only(name, task):
    torch.manual_seed(0)
    model = build_model(name, size="tiny", task=task, dropout=0.5)
    x = _inputs(task)
    assert not torch.equal(model.train()(x), model(x))
    assert torch.equal(model.eval()(x), model(x))
