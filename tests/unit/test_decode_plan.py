"""moe.decode_plan: decode steps on each layer's resolved ops against the module path, bit for bit,
and the plan remade (or dropped) whenever a switch or a weight it bound changes."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from moe import decode_plan, kernels, plan_watch
from moe.config import ModelConfig
from moe.kv_cache import AttentionMetadata, PagedKVCache
from moe.loader import load_weights
from moe.model import MoEModel

BLOCK = 4
FAMILIES = ["deepseek_v2", "deepseek_v3", "mixtral", "qwen3_moe"]


def _model(path: Path, dtype: torch.dtype) -> MoEModel:
    model = MoEModel(ModelConfig.from_hf(path), dtype=dtype)
    load_weights(model, path, dtype=dtype)
    return model


class _Run:
    """Prompts prefilled in one mixed step, then greedy decode steps over a cache in the model's dtype;
    sequence b stops after new_tokens[b] tokens, so the decode batch shrinks (3, 2, 1 rows)."""

    def __init__(self, model: MoEModel, prompts: list[list[int]], new_tokens: list[int]) -> None:
        self.model, self.seqs, self.new_tokens = model, [list(p) for p in prompts], new_tokens
        per_seq = -(-(max(map(len, prompts)) + max(new_tokens)) // BLOCK)
        self.cache = PagedKVCache(model.config, per_seq * len(prompts) + 1, BLOCK, model.dtype)
        self.tables = [[1 + b + len(prompts) * i for i in range(per_seq)] for b in range(len(prompts))]
        self.done = [0] * len(prompts)
        self.generated = [0] * len(prompts)

    def step(self) -> torch.Tensor | None:
        """One step over the unfinished sequences; its hidden rows [T, D], or None when all are done."""
        active = [b for b in range(len(self.seqs)) if self.generated[b] < self.new_tokens[b]]
        if not active:
            return None
        qlens = [len(self.seqs[b]) - self.done[b] for b in active]
        ids = torch.tensor([t for b in active for t in self.seqs[b][self.done[b]:]])
        pos = torch.tensor([p for b in active for p in range(self.done[b], len(self.seqs[b]))])
        ctx = [len(self.seqs[b]) for b in active]
        meta = AttentionMetadata.build(qlens, ctx, [self.tables[b] for b in active], BLOCK)
        with torch.inference_mode():
            hidden = self.model(ids, pos, meta, self.cache)
            logits = self.model.compute_logits(hidden[meta.logits_indices()])
        for row, b in enumerate(active):
            self.done[b] = len(self.seqs[b])
            self.seqs[b].append(int(logits[row].argmax()))
            self.generated[b] += 1
        return hidden

    def slot_loads(self) -> list[torch.Tensor]:
        return [layer.slot_load.clone() for layer in self.model.moe_layers()]


@pytest.fixture
def plans_made(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row count of every DecodePlan made."""
    made: list[int] = []
    make = decode_plan.DecodePlan.__init__

    def spy(self: decode_plan.DecodePlan, layers: list, final_norm: torch.nn.Module, x: torch.Tensor,
            kv_cache: PagedKVCache, lm_head: torch.nn.Module | None = None) -> None:
        made.append(x.shape[0])
        make(self, layers, final_norm, x, kv_cache, lm_head)

    monkeypatch.setattr(decode_plan.DecodePlan, "__init__", spy)
    return made


def _twin_runs(model: MoEModel, mutations: dict[int, Callable[[MoEModel], None]] | None = None
               ) -> tuple[list[torch.Tensor], list[torch.Tensor], _Run, _Run]:
    """The same steps on a plan (model) and on the modules (a deep copy), with mutations[k](model)
    applied to both before step k. Returns both runs' hidden rows per step and the runs."""
    twin = copy.deepcopy(model)
    twin.use_decode_plan = False
    prompts, new_tokens = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]], [6, 4, 2]
    runs = (_Run(model, prompts, new_tokens), _Run(twin, prompts, new_tokens))
    outs: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for k in range(max(new_tokens)):
        for run, out in zip(runs, outs):
            if mutations and k in mutations:
                mutations[k](run.model)
            out.append(run.step())
    return outs[0], outs[1], runs[0], runs[1]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plan_steps_are_bit_equal_to_the_module_path(kernel_isas: list[str], hf_checkpoints: dict[str, Path],
                                                     family: str, dtype: torch.dtype, plans_made: list[int]) -> None:
    model = _model(hf_checkpoints[family], dtype)
    planned, modules, run, twin = _twin_runs(model)
    d = model.config.hidden_size
    assert [h.shape for h in planned] == [(15, d), (3, d), (2, d), (2, d), (1, d), (1, d)]
    for k, (a, b) in enumerate(zip(planned, modules)):
        assert a.dtype == dtype and torch.equal(a, b), (family, dtype, k)
    for a, b in zip(run.cache.pools, twin.cache.pools):
        assert torch.equal(a, b)
    for a, b in zip(run.slot_loads(), twin.slot_loads()):
        assert torch.equal(a, b) and a.sum() > 0
    assert run.seqs == twin.seqs
    # one plan served the five decode steps as the batch shrank from 3 rows to 1
    assert plans_made == [3]
    plan = model._plan
    assert plan is not None
    assert plan._watch is not None and plan._quiet()  # every family's modules announce their changes
    layers = list(model.model.layers)
    # the whole-block ops are bound where they apply (MLA and GQA attention; the MoE FFN on a rank
    # hosting all slots)
    assert [layer for layer, _ in plan._ops] == layers
    resolved = [ops for _, ops in plan._ops]  # (attention, add + norm2, FFN, add + next norm) per layer
    assert all(ops[0] is not layer.self_attn for ops, layer in zip(resolved, layers))
    assert all(ops[2] is not layer.mlp for ops, layer in zip(resolved, layers))
    assert plan._first_norm is not layers[0].input_layernorm
    # every residual add runs with the norm after it: the kernel's add_rms_norm, bound to that norm's weight
    norms = [layer.post_attention_layernorm for layer in layers]
    nexts = [layer.input_layernorm for layer in layers[1:]] + [model.model.norm]
    for ops, norm2, after in zip(resolved, norms, nexts):
        for add_norm, norm in ((ops[1], norm2), (ops[3], after)):
            bound = dict(zip(add_norm.__code__.co_freevars, (c.cell_contents for c in add_norm.__closure__)))
            assert add_norm.__name__ == "add_norm" and bound["weight"] is norm.weight


def _scale_experts(model: MoEModel) -> None:
    with torch.no_grad():
        next(model.moe_layers()).experts.w2.mul_(2)  # in place: the packed copy is stale


def _replace_o_proj(model: MoEModel) -> None:
    o_proj = model.model.layers[-1].self_attn.o_proj
    o_proj.weight = torch.nn.Parameter(o_proj.weight.detach() * 0.5, requires_grad=False)


def _one_attention_op_by_op(model: MoEModel) -> None:
    model.model.layers[0].self_attn.use_fused_decode = False


@pytest.mark.parametrize("mutation", [_scale_experts, _replace_o_proj, _one_attention_op_by_op,
                                      lambda m: m.set_fused_ops(False)])
def test_plan_is_remade_when_a_weight_or_switch_changes(kernel_isas: list[str], hf_checkpoints: dict[str, Path],
                                                        mutation: Callable[[MoEModel], None],
                                                        plans_made: list[int]) -> None:
    model = _model(hf_checkpoints["deepseek_v3"], torch.bfloat16)
    planned, modules, run, twin = _twin_runs(model, {3: mutation})
    for k, (a, b) in enumerate(zip(planned, modules)):
        assert torch.equal(a, b), k
    assert plans_made == [3, 2]  # made at the first decode step and again after the change (step 3, two rows)
    assert run.seqs == twin.seqs


def test_plan_switched_off_and_back_on(kernel_isas: list[str], hf_checkpoints: dict[str, Path],
                                       plans_made: list[int]) -> None:
    model = _model(hf_checkpoints["deepseek_v3"], torch.bfloat16)
    switches = {2: lambda m: m.set_fused_ops(False), 4: lambda m: m.set_fused_ops(True)}
    planned, modules, _, _ = _twin_runs(model, switches)
    assert all(torch.equal(a, b) for a, b in zip(planned, modules))
    assert plans_made == [3, 2, 1]


def test_a_weight_change_drops_the_plan_at_the_next_mixed_step(kernel_isas: list[str],
                                                               hf_checkpoints: dict[str, Path]) -> None:
    model = _model(hf_checkpoints["deepseek_v3"], torch.bfloat16)
    run = _Run(model, [[5, 6, 7], [8, 9]], [5, 5])
    run.step()  # prefill
    run.step()  # decode: makes the plan
    assert model._plan is not None
    run.seqs[0] += [20, 21]  # sequence 0 gets a prompt extension: the next step mixes a chunk in
    run.step()
    assert model._plan is not None  # nothing changed: kept (no bound weights dropped)
    _scale_experts(model)
    run.seqs[1] += [22, 23]
    run.step()
    assert model._plan is None  # its packed copies would outlive the modules' repacking


def test_plan_needs_decode_rows_outside_autograd(hf_checkpoints: dict[str, Path]) -> None:
    x = torch.zeros(2, 8)
    decode = AttentionMetadata.build([1, 1], [3, 4], [[1], [2]], BLOCK)
    mixed = AttentionMetadata.build([2, 1], [3, 4], [[1], [2]], BLOCK)
    with torch.no_grad():
        assert decode_plan.plan_applies(x, decode)
        assert not decode_plan.plan_applies(torch.zeros(3, 8), mixed)
        assert not decode_plan.plan_applies(x[:0], AttentionMetadata.build([], [], [], BLOCK))
    assert not decode_plan.plan_applies(x, decode)  # grad mode on: the modules' PyTorch paths run


def test_every_switch_of_the_layers_is_in_the_plan_state(kernel_isas: list[str],
                                                         hf_checkpoints: dict[str, Path]) -> None:
    model = _model(hf_checkpoints["deepseek_v3"], torch.bfloat16)
    run = _Run(model, [[5, 6, 7]], [3])
    run.step()
    run.step()
    plan = model._plan
    assert plan is not None
    x = torch.zeros(1, model.config.hidden_size, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert plan.state(x, run.cache) == plan.key
    switched = {name for _, name in plan._switches}
    assert {"use_kernel", "use_fused_decode", "use_fused_rope_cache", "use_paged_kernel", "use_fused_ffn",
            "fused_topk", "quantization", "capacity", "dispatcher"} <= switched
    for module, name in plan._switches:
        value = getattr(module, name)
        if isinstance(value, bool):
            setattr(module, name, not value)
            with torch.inference_mode():
                assert plan.state(x, run.cache) != plan.key, (type(module).__name__, name)
            setattr(module, name, value)
    assert kernels.is_available()


def _plan_after_two_steps(model: MoEModel) -> tuple[decode_plan.DecodePlan, _Run, torch.Tensor]:
    run = _Run(model, [[5, 6, 7]], [4])
    run.step()
    run.step()
    plan = model._plan
    assert plan is not None
    return plan, run, torch.zeros(1, model.config.hidden_size, dtype=model.dtype)


def test_decode_steps_answer_from_the_announcements(kernel_isas: list[str], hf_checkpoints: dict[str, Path],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan armed with a watch (every module that matters announces its changes) serves later decode
    steps without reading the switches and parameters back; the steps announce nothing."""
    model = _model(hf_checkpoints["deepseek_v3"], torch.bfloat16)
    plan, run, _ = _plan_after_two_steps(model)
    # the layers', the final norm's and lm_head's parameters
    assert plan._watch is not None and plan._watch.size() == sum(1 for _ in model.model.layers.parameters()) + 2
    # read back every step: only the switches held on a class
    assert [(owner.__name__, name) for owner, name in plan._read_back] == [
        ("Linear", "use_kernel"), ("RMSNorm", "use_kernel"), ("Router", "use_kernel")]
    full_reads = []
    monkeypatch.setattr(decode_plan.DecodePlan, "_weights", lambda self: full_reads.append(1) or ())
    announced = plan_watch.epoch()
    run.step()
    run.step()
    assert model._plan is plan and full_reads == [] and plan_watch.epoch() == announced


def _flip_instance_switch(model: MoEModel) -> Callable[[], None]:
    attn = model.model.layers[1].self_attn
    attn.use_paged_kernel = False
    return lambda: setattr(attn, "use_paged_kernel", True)


def _flip_class_switch(model: MoEModel) -> Callable[[], None]:
    from moe.layers import RMSNorm

    RMSNorm.use_kernel = False
    return lambda: setattr(RMSNorm, "use_kernel", True)


def _swap_dispatcher(model: MoEModel) -> Callable[[], None]:
    layer = next(model.moe_layers())
    kept = layer.dispatcher
    layer.dispatcher = copy.copy(kept)  # a mutable switch value: its assignment is announced
    return lambda: setattr(layer, "dispatcher", kept)


def _write_in_place(model: MoEModel) -> None:
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.add_(0)  # a version bump, the same values


def _new_storage(model: MoEModel) -> None:
    weight = model.model.layers[2].self_attn.kv_a_layernorm.weight
    weight.data = weight.data.clone()


def _register_again(model: MoEModel) -> None:
    norm = model.model.norm
    norm.register_parameter("weight", torch.nn.Parameter(norm.weight.detach().clone(), requires_grad=False))


@pytest.mark.parametrize("switch", [_flip_instance_switch, _flip_class_switch, _swap_dispatcher])
def test_a_switch_change_is_seen_and_undone(kernel_isas: list[str], hf_checkpoints: dict[str, Path],
                                            switch: Callable[[MoEModel], Callable[[], None]]) -> None:
    model = _model(hf_checkpoints["deepseek_v3"], torch.bfloat16)
    plan, run, x = _plan_after_two_steps(model)
    with torch.inference_mode():
        assert plan.holds(x, run.cache)
        undo = switch(model)
        try:
            assert not plan.holds(x, run.cache)
        finally:
            undo()
        assert plan.holds(x, run.cache)  # the same state again (re-armed after the announcement)
        assert plan._quiet()


@pytest.mark.parametrize("change", [_write_in_place, _new_storage, _register_again, _scale_experts, _replace_o_proj])
def test_a_weight_change_is_seen(kernel_isas: list[str], hf_checkpoints: dict[str, Path],
                                 change: Callable[[MoEModel], None]) -> None:
    model = _model(hf_checkpoints["deepseek_v3"], torch.bfloat16)
    plan, run, x = _plan_after_two_steps(model)
    change(model)
    with torch.inference_mode():
        assert not plan._quiet() and not plan.holds(x, run.cache) and plan.weights_changed()


def test_a_module_that_does_not_announce_turns_the_watch_off(kernel_isas: list[str],
                                                              hf_checkpoints: dict[str, Path]) -> None:
    """A plain nn.Linear swapped into a layer cannot announce a new weight: its plan compares the
    whole state every step, and still sees the change."""
    model = _model(hf_checkpoints["deepseek_v3"], torch.bfloat16)
    mlp = model.model.layers[0].mlp
    plain = torch.nn.Linear(mlp.down_proj.in_features, mlp.down_proj.out_features, bias=False, dtype=torch.bfloat16)
    plain.weight = torch.nn.Parameter(mlp.down_proj.weight.detach(), requires_grad=False)
    mlp.down_proj = plain
    plan, run, x = _plan_after_two_steps(model)
    assert plan._watch is None and not plan._quiet()
    with torch.inference_mode():
        assert plan.holds(x, run.cache)
    plain.__dict__["_parameters"]["weight"] = torch.nn.Parameter(plain.weight.detach().clone(), requires_grad=False)
    with torch.inference_mode():
        assert not plan.holds(x, run.cache)


def test_tensor_watch_sees_writes_and_new_storage_and_checks_its_handle(kernel_isas: list[str]) -> None:
    a, b = torch.ones(3), torch.zeros(2, dtype=torch.bfloat16)
    watch = kernels.tensor_watch([a, b])
    assert watch is not None and watch.size() == 2 and not watch.changed()
    b.add_(0)  # the same values, a new version
    assert watch.changed()
    watch = kernels.TensorWatch([a, b])
    a.data = torch.ones(3)  # new storage, the same Parameter-like object
    assert watch.changed()
    handle = watch.handle
    del watch  # dropped: its handle is refused
    with pytest.raises(RuntimeError, match="no tensor watch"):
        torch.ops.moe_kernels.tensor_watch_changed(handle)
    assert not kernels.TensorWatch([]).changed()


def test_decode_logits_run_the_plans_lm_head_op_bit_equal(kernel_isas: list[str], hf_checkpoints: dict[str, Path],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """After a forward on the plan, compute_logits of its rows calls the plan's bound lm_head op (not
    the module), with the module's bits; after a mixed step, the module again."""
    model = _model(hf_checkpoints["deepseek_v3"], torch.bfloat16)
    plan, run, _ = _plan_after_two_steps(model)
    assert plan.lm_head is not None and plan.lm_head is not model.lm_head
    module_calls = []
    forward = model.lm_head.forward
    monkeypatch.setattr(model.lm_head, "forward", lambda x: module_calls.append(x.shape) or forward(x))
    hidden = run.step()  # a decode step: its logits through the plan's op
    assert module_calls == [] and model._plan is plan
    with torch.inference_mode():
        assert torch.equal(model.lm_head(hidden).float(), plan.lm_head(hidden).float())
    run.seqs[0] += [30, 31]  # a prompt extension: the next step is mixed and runs the module
    run.step()
    assert len(module_calls) == 2


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_steps_fuse_each_residual_add_into_the_norm_after_it(kernel_isas: list[str],
                                                                   hf_checkpoints: dict[str, Path], family: str,
                                                                   dtype: torch.dtype,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps off the plan (prefill and mixed rows) run each residual add in one op with the norm after
    it, bit-equal to calling each DecoderLayer (its adds and norms apart), then the final norm."""
    model = _model(hf_checkpoints[family], dtype)
    model.use_decode_plan = False
    twin = copy.deepcopy(model)

    def layer_by_layer(self: MoEModel, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       kv_cache: PagedKVCache) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary(positions, max(meta.context_lens_list, default=0) - 1)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, meta, kv_cache.layer(i))
        return self.model.norm(h)

    twin.forward = layer_by_layer.__get__(twin)
    fused: list[int] = []
    add_rms_norm = kernels.add_rms_norm
    monkeypatch.setattr(kernels, "add_rms_norm", lambda h, *a: fused.append(h.shape[0]) or add_rms_norm(h, *a))
    prompts, new_tokens = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]], [3, 2, 1]
    runs = _Run(model, prompts, new_tokens), _Run(twin, prompts, new_tokens)
    steps = 0
    while True:
        before = len(fused)
        got, want = runs[0].step(), runs[1].step()
        if got is None:
            assert want is None
            break
        steps += 1
        assert got.dtype == dtype and torch.equal(got, want), (family, dtype, steps)
        # two fused adds per layer on the model, none on the layer-by-layer twin
        assert fused[before:] == [got.shape[0]] * (2 * len(model.model.layers))
    assert steps == 3 and runs[0].seqs == runs[1].seqs
    for a, b in zip(runs[0].cache.pools, runs[1].cache.pools):
        assert torch.equal(a, b)


def test_the_op_by_op_moe_path_counts_load_without_announcing_a_change(tiny_ckpt: Path) -> None:
    """A forward through the MoE layer's op-by-op path (as expert parallelism or a capacity factor
    take) adds its slot load in place: the counts grow, the buffer stays the same tensor, and no
    change is announced, so a decode plan's quick check keeps holding from step to step."""
    model = _model(tiny_ckpt, torch.float32)
    layer = next(model.moe_layers())
    layer.use_fused_ffn = False
    load = layer.slot_load
    before_epoch, before = plan_watch.epoch(), load.clone()
    x = torch.randn(5, model.config.hidden_size)
    with torch.inference_mode():
        layer(x)
    assert layer.slot_load is load and int((load - before).sum()) == 5 * layer.top_k
    assert plan_watch.epoch() == before_epoch
