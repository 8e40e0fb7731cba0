"""The student side of distillation: what it outputs, its projections, its initialisation.

The trainer trains a `Distilled` module: the student plus the learned projections of the
hidden-state loss (FitNets' regressors, TinyBERT's W_h), one Linear per mapped hidden state
from the student's width to the teacher's. Keeping them in one module means data parallel
averages their gradients, the optimizer steps them and the checkpoint holds them like any
weight, with no special case; the run's model.safetensors holds the student alone
(`student_weights`).

Initialisation follows models/init.py's module rule, so that a student too big for one rank
can be built on the meta device and each rank materialise its shards: `Distilled` is the
initialiser of its projections (`init_module`: torch's default Linear init, then the identity
and a zero bias when the widths are equal), each drawn from (train.seed, "proj.i"), and its
student draws as it would alone (`init_scopes`). A real student (distill.init_layers copies
teacher values into it now, or a user model that cannot be built on meta) gets the same
projections, drawn by the same rule at construction: every layout and both paths agree.

`Distilled.forward` returns a `StudentOutput`: the logits (classifiers and language models:
the hard loss and accuracy read `.logits`), the last hidden state, the projected hidden
states of the mapped layers and the attention maps, as the losses need them. Hidden states
and attention maps come from a Hugging Face model's own `output_hidden_states` /
`output_attentions`; a built-in or user model gives logits only.

Layer map: student hidden state m (0 = the embeddings' output, m = 1..M the blocks') learns
teacher state `layer_map[m]`; the attention of student block m learns teacher block
layer_map[m]'s. [] = TinyBERT's uniform map g(m) = m x N / M.

Last-layer projections (the relation term, MiniLM): the outputs of the last block's `query`,
`key` and `value` Linear modules (BERT's names, kept by RoBERTa, ELECTRA and MiniLM), caught
by forward hooks held for one forward only (`capture_outputs`): exactly the tensors the
attention multiplies, whatever attention kernel runs (sdpa gives no attention maps), and
nothing caught when activation checkpointing runs the block again in backward. The teacher
is read the same way (teacher.py).

Initialisation from teacher layers (DistilBERT took every other layer of BERT): student
block i becomes a copy of teacher block `init_layers[i]`, and every other student weight
whose name and shape the teacher has (embeddings, final norm, pooler) is copied too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from scaletrain.distill.losses import uniform_layer_map
from scaletrain.models.init import draw, is_meta
from scaletrain.models.protocol import model_spec
from scaletrain.user_code import UserCodeError


@dataclass
class StudentOutput:
    logits: torch.Tensor | None  # (B, C) or (B, T, V); None for an encoder
    last_hidden: torch.Tensor | None  # (B, T, D) an encoder's output
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # m -> (B, T, D_teacher)
    attentions: dict[int, torch.Tensor] = field(default_factory=dict)  # m -> (B, H, T, T)
    qkv: dict[str, torch.Tensor] = field(default_factory=dict)  # "query"/"key"/"value" (B, T, D)


# A pytree node, so that FSDP2 and DDP find the tensors in the student's output (FSDP2 hooks
# the root's pre-backward on them; an opaque object would hide them).
torch.utils._pytree.register_dataclass(StudentOutput)


class Distilled(nn.Module):
    """The student and its hidden-state projections, trained together. On the meta device
    when the student is (the trainer materialises each rank's shards); real otherwise."""

    init_scopes = ("student",)  # models/init.py: the student draws as it would alone

    def __init__(
        self,
        student: nn.Module,
        *,
        layer_map: list[int],
        teacher_width: int,
        hidden: bool,
        attentions: bool,
        hugging_face: bool,
        seed: int = 0,
        relations: bool = False,
    ) -> None:
        """`seed`: train.seed, from which a real student's projections are drawn here (a
        meta student's, with it, when the trainer materialises it). `relations`: also return
        the last layer's query, key and value (the relation term)."""
        super().__init__()
        self.student = student
        self.layer_map, self.want_hidden, self.want_attn = layer_map, hidden, attentions
        self.want_qkv = relations
        if relations:
            last_layer_qkv(student)  # refused now, not at the first forward
        self.hugging_face = hugging_face
        width = _width(student) if hidden else 0
        with torch.device("meta"):  # shapes now; the values by the module rule
            self.proj = nn.ModuleList(
                nn.Linear(width, teacher_width) for _ in (layer_map if hidden else [])
            )
        if not is_meta(student):
            self._draw_projections(seed=seed, device=_device(student))

    def init_module(self, name: str, module: nn.Module) -> None:
        """models/init.py's initialiser of a projection (student width -> teacher width):
        torch's default Linear init, then the identity and a zero bias when the widths are
        equal (a student initialised from teacher layers then starts where the teacher is,
        as TinyBERT's W_h would learn). From torch's global RNG only, as the rule asks.
        The student's own modules have their own initialisers, nearer than this one."""
        module.reset_parameters()
        if module.in_features == module.out_features:
            with torch.no_grad():
                module.weight.copy_(torch.eye(module.in_features))
                module.bias.zero_()

    def _draw_projections(self, *, seed: int, device: torch.device) -> None:
        """A real student's projections: the values `materialize` gives a meta one's (the
        same name, initialiser and seed), in real tensors on the student's device."""
        for i, proj in enumerate(self.proj):
            values = draw(f"proj.{i}", proj, init=self.init_module, seed=seed)
            proj.to_empty(device=device)
            with torch.no_grad():
                for attr, value in values.items():
                    getattr(proj, attr).copy_(value)

    def forward(self, inputs: torch.Tensor, **extras) -> StudentOutput:
        if not self.hugging_face:
            out = self.student(inputs, **extras)
            return StudentOutput(
                logits=out if isinstance(out, torch.Tensor) else out.logits, last_hidden=None
            )
        # Found on every forward: activation checkpointing wraps the blocks after this
        # module is built, which changes their modules' names (not the Linear modules).
        qkv_modules = last_layer_qkv(self.student) if self.want_qkv else ()
        with capture_outputs(qkv_modules) as qkv:
            out = self.student(
                inputs,
                output_hidden_states=self.want_hidden,
                output_attentions=self.want_attn,
                **extras,
            )
        logits = getattr(out, "logits", None)
        last = None if logits is not None else out.last_hidden_state
        hidden = (
            {m: self.proj[m](out.hidden_states[m]) for m in range(len(self.layer_map))}
            if self.want_hidden
            else {}
        )
        attn = (
            {m: out.attentions[m - 1] for m in range(1, len(self.layer_map))}
            if self.want_attn
            else {}
        )
        return StudentOutput(
            logits=logits,
            last_hidden=last,
            hidden=hidden,
            attentions=attn,
            qkv=dict(zip(QKV, qkv)),
        )


QKV = ("query", "key", "value")


def last_layer_qkv(model: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module]:
    """The query, key and value Linear modules of the model's last block (self-attention;
    a decoder's cross-attention excluded).

    Raises:
        UserCodeError: the model has no repeated blocks, or its last has no such modules
            (a fused qkv, another naming): the relation term cannot read it.
    """
    block = model.get_submodule(model_spec(model).blocks or "")
    last = block[-1] if isinstance(block, (nn.ModuleList, nn.Sequential)) else None
    found = {
        name.rsplit(".", 1)[-1]: module
        for name, module in (last.named_modules() if last is not None else ())
        if isinstance(module, nn.Linear) and "crossattention" not in name
    }
    if any(k not in found for k in QKV):
        raise UserCodeError(
            f"distill.relation_weight reads the self-attention's query, key and value "
            f"projections of the last block, and {type(model).__name__} has no Linear "
            "modules named query, key and value there (a BERT-style encoder has them: "
            "BERT, RoBERTa, ELECTRA, MiniLM); set distill.relation_weight = 0"
        )
    return found["query"], found["key"], found["value"]


@contextlib.contextmanager
def capture_outputs(modules: tuple[nn.Module, ...]) -> Iterator[list[torch.Tensor | None]]:
    """A list whose slot i holds modules[i]'s output of the forward run inside the block
    (None if it did not run). The hooks are removed on leaving: a later forward (activation
    checkpointing's recomputation in backward) overwrites nothing."""
    caught: list[torch.Tensor | None] = [None] * len(modules)
    handles = [
        m.register_forward_hook(lambda _m, _args, out, i=i: caught.__setitem__(i, out))
        for i, m in enumerate(modules)
    ]
    try:
        yield caught
    finally:
        for h in handles:
            h.remove()


def _device(model: nn.Module) -> torch.device:
    return next((t.device for t in (*model.parameters(), *model.buffers())), torch.device("cpu"))


def _width(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    width = getattr(config, "hidden_size", None)
    if width is None:
        raise UserCodeError(
            "distill.hidden_weight > 0 needs the student's hidden size "
            "(config.hidden_size of a Hugging Face model)"
        )
    return int(width)


def n_blocks(model: nn.Module) -> int:
    """The number of repeated blocks (layers) of a model, from its ModelSpec."""
    spec = model_spec(model)
    if spec.blocks is None:
        raise UserCodeError(
            f"{type(model).__name__} has no repeated blocks to map or copy "
            "(a ModelSpec's blocks); the layer map and init_layers need them"
        )
    return len(model.get_submodule(spec.blocks))


def resolve_layer_map(
    layer_map: list[int], *, student_layers: int, teacher_layers: int, attention: bool = False
) -> list[int]:
    """distill.layer_map checked, or the uniform map: M + 1 entries, each a teacher state 0..N
    (under the attention loss, a student layer's entry 1..N: the embeddings have no attention
    map). Any order is allowed (a student layer may learn any teacher layer)."""
    mapping = list(layer_map) or uniform_layer_map(student_layers, teacher_layers)
    if len(mapping) != student_layers + 1:
        raise UserCodeError(
            f"distill.layer_map = {layer_map} has {len(mapping)} entries; the "
            f"student has {student_layers} layers, so it needs "
            f"{student_layers + 1} (the embeddings' state first, then one per "
            f"layer), each a teacher state 0..{teacher_layers}"
        )
    bad = [t for t in mapping if not 0 <= t <= teacher_layers]
    if bad:
        raise UserCodeError(
            f"distill.layer_map = {mapping}: entries {bad} are not teacher "
            f"states 0..{teacher_layers} (0 = embeddings)"
        )
    if attention and 0 in mapping[1:]:
        raise UserCodeError(
            f"distill.layer_map = {mapping} maps a student layer to the teacher's "
            "embeddings (0), which have no attention map for "
            "distill.attention_weight; give student layers 1.."
            f"{teacher_layers}"
        )
    return mapping


@torch.no_grad()
def init_from_teacher(student: nn.Module, teacher: nn.Module, layers: list[int]) -> list[str]:
    """Copy teacher blocks `layers` into the student's blocks and the other matching weights.

    Returns the student's parameter names that were copied.

    Raises:
        UserCodeError: the counts or shapes do not fit (nothing is copied then).
    """
    s_blocks = student.get_submodule(model_spec(student).blocks or "")
    t_blocks = teacher.get_submodule(model_spec(teacher).blocks or "")
    if len(layers) != len(s_blocks) or not all(0 <= i < len(t_blocks) for i in layers):
        raise UserCodeError(
            f"distill.init_layers = {layers}: the student has {len(s_blocks)} "
            f"blocks (one teacher block each) and the teacher {len(t_blocks)} "
            f"(0..{len(t_blocks) - 1})"
        )
    s_prefix, t_prefix = model_spec(student).blocks + ".", model_spec(teacher).blocks + "."
    t_params = dict(teacher.state_dict())
    plan: dict[str, torch.Tensor] = {}
    for name, p in student.state_dict().items():
        if name.startswith(s_prefix):
            index, rest = name[len(s_prefix) :].split(".", 1)
            source = f"{t_prefix}{layers[int(index)]}.{rest}"
        else:
            source = name
        t = t_params.get(source)
        if t is None:
            continue
        if t.shape != p.shape:
            raise UserCodeError(
                f"distill.init_layers: the student's {name} is {tuple(p.shape)} "
                f"but the teacher's {source} is {tuple(t.shape)}; initialising "
                "from teacher layers needs the teacher's widths"
            )
        plan[name] = t
    if not any(n.startswith(s_prefix) for n in plan):
        raise UserCodeError("distill.init_layers: no student block weight matches the teacher's")
    state = student.state_dict()
    for name, t in plan.items():
        state[name].copy_(t.to(state[name].dtype))
    return sorted(plan)


def student_weights(
    net: nn.Module, weights: dict[str, torch.Tensor] | str | None
) -> tuple[nn.Module, dict[str, torch.Tensor] | str | None]:
    """The student alone (and its gathered weights' names without the 'student.' prefix;
    `weights` that are not a state dict, finish.WRITTEN or None, as they are)."""
    if not isinstance(net, Distilled):
        return net, weights
    return net.student, strip_wrapper(weights) if isinstance(weights, dict) else weights


def strip_wrapper(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Distilled module's weights as the bare student's: 'student.' removed, projections
    dropped. Other weights (a run without [distill]) are returned as they are."""
    if not all(k.startswith(("student.", "proj.")) for k in weights) or not any(
        k.startswith("student.") for k in weights
    ):
        return weights  # not a Distilled module's: a model that merely has a "student" part
    return {k.removeprefix("student."): v for k, v in weights.items() if k.startswith("student.")}
