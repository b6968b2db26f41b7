"""WQExperts: per-expert state-dict names, bit-identical round trips, from_experts/to_experts."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fastawq import reference
from fastawq.modules.moe import WQExperts
from fastawq.modules.qlinear import WQLinear

from conftest import random_input

E, H, I, G = 4, 64, 96, 32


def random_experts(e=E, h=H, i=I, g=G, seed=0) -> list[tuple[WQLinear, WQLinear, WQLinear]]:
    torch.manual_seed(seed)
    out = []
    for _ in range(e):
        triple = []
        for k, n in ((h, i), (h, i), (i, h)):
            triple.append(WQLinear.from_linear(nn.Linear(k, n, bias=False).half(), g))
        out.append(tuple(triple))
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("g", [G, -1])
def test_from_experts_then_to_experts_is_exact(g):
    experts = random_experts(g=g)
    mod = WQExperts.from_experts(experts)
    assert mod.group_size == g
    for orig, back in zip(experts, mod.to_experts()):
        for a, b in zip(orig, back):
            assert (a.in_features, a.out_features, a.group_size) == (b.in_features, b.out_features, b.group_size)
            assert all(_same(getattr(a, p), getattr(b, p)) for p in ("qweight", "qzeros", "scales"))


def test_forward_is_the_sum_of_the_routed_experts():
    experts = random_experts(seed=1)
    mod = WQExperts.from_experts(experts)
    x = random_input((5, H), "cpu", torch.float16, seed=2)
    weights, ids = reference.topk_route(random_input((5, E), "cpu", torch.float32, seed=3), 2)
    out = mod(x, ids, weights)
    expect = torch.zeros(5, H)
    for t in range(5):
        for j in range(2):
            gate, up, down = experts[ids[t, j]]
            xt = x[t:t + 1].float()
            h = torch.nn.functional.silu(reference.awq_gemm(xt, gate.qweight, gate.scales.float(), gate.qzeros, G)) \
                * reference.awq_gemm(xt, up.qweight, up.scales.float(), up.qzeros, G)
            expect[t] += weights[t, j] * reference.awq_gemm(h, down.qweight, down.scales.float(), down.qzeros, G)[0]
    torch.testing.assert_close(out.float(), expect, rtol=2e-2, atol=2e-2 * expect.abs().max().item())
    batched = mod(x[:4].reshape(2, 2, H), ids[:4].reshape(2, 2, 2), weights[:4].reshape(2, 2, 2))
    torch.testing.assert_close(batched.reshape(4, H), out[:4], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("names", [("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")])
def test_state_dict_names_are_per_expert(names):
    block = nn.Module()
    block.experts = WQExperts.from_experts(random_experts(seed=4), proj_names=names)
    sd = block.state_dict()
    expect = {f"experts.{e}.{n}.{p}" for e in range(E) for n in names for p in ("qweight", "qzeros", "scales")}
    assert set(sd) == expect
    gate, up, down = block.experts.to_experts()[2]
    assert _same(sd[f"experts.2.{names[0]}.qweight"], gate.qweight)
    assert _same(sd[f"experts.2.{names[1]}.scales"], up.scales)
    assert _same(sd[f"experts.2.{names[2]}.qzeros"], down.qzeros)
    # Views into the stacked buffers: no copy of the experts just to list the names.
    base = block.experts.w13_qweight.untyped_storage().data_ptr()
    assert sd["experts.1.gate_proj.qweight".replace("gate_proj", names[0])].untyped_storage().data_ptr() == base


@pytest.mark.parametrize("assign", [False, True])
def test_state_dict_round_trip_is_bit_identical(assign, tmp_path):
    from safetensors.torch import load_file, save_file

    from fastawq.checkpoint import _state_dict_for_save

    src = nn.Module()
    src.experts = WQExperts.from_experts(random_experts(seed=5), proj_names=("w1", "w3", "w2"))
    # The checkpoint writer's own state-dict pass (dedupe of tied tensors, contiguous CPU copies).
    save_file(_state_dict_for_save(src), tmp_path / "experts.safetensors")
    sd = load_file(tmp_path / "experts.safetensors")
    dst = nn.Module()
    dst.experts = WQExperts(E, H, I, G, proj_names=("w1", "w3", "w2"))
    result = dst.load_state_dict(sd, strict=True, assign=assign)
    assert not result.missing_keys and not result.unexpected_keys
    for name, buf in src.experts.named_buffers():
        assert _same(buf, getattr(dst.experts, name)), name
    assert all(_same(sd[k], v) for k, v in dst.state_dict().items())


def test_load_reports_missing_and_unexpected_keys():
    sd = WQExperts.from_experts(random_experts(seed=6)).state_dict()
    del sd["3.down_proj.scales"]
    sd["3.gate_proj.bias"] = torch.zeros(I)
    mod = WQExperts(E, H, I, G)
    with pytest.raises(RuntimeError, match=r"3\.down_proj\.scales"):
        mod.load_state_dict(sd)
    result = mod.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["3.down_proj.scales"]
    assert result.unexpected_keys == ["3.gate_proj.bias"]


def test_load_rejects_wrong_shapes_by_name():
    sd = WQExperts.from_experts(random_experts(seed=7)).state_dict()
    mod = WQExperts(E, H, 2 * I, G)
    with pytest.raises(RuntimeError, match="size mismatch"):
        mod.load_state_dict(sd)


def test_meta_init_then_assign_load():
    # Checkpoint loaders build the model on the meta device and assign the loaded tensors.
    sd = WQExperts.from_experts(random_experts(seed=8)).state_dict()
    with torch.device("meta"):
        mod = WQExperts(E, H, I, G)
    mod.load_state_dict(sd, assign=True)
    assert mod.w13_qweight.device.type == "cpu"
    x = random_input((2, H), "cpu", torch.float16, seed=9)
    ids = torch.tensor([[0, 3], [2, 1]])
    assert torch.isfinite(mod(x, ids, torch.full((2, 2), 0.5))).all()


def test_constructor_errors_name_the_argument():
    with pytest.raises(ValueError, match="intermediate_size=100"):
        WQExperts(E, H, 100, G)
    with pytest.raises(ValueError, match="group_size=48"):
        WQExperts(E, H, I, 48)
    with pytest.raises(ValueError, match="act"):
        WQExperts(E, H, I, G, act="relu")
    experts = random_experts(seed=9)
    experts[1] = (experts[1][0], experts[1][1], WQLinear(I, H, 16, False))
    with pytest.raises(ValueError, match="expert 1 down"):
        WQExperts.from_experts(experts)


def test_compiles_to_one_graph_through_the_custom_op():
    # Backend dispatch reads the environment and imports modules: under torch.compile it happens
    # inside the op at run time, so the module traces without a graph break.
    mod = WQExperts.from_experts(random_experts(seed=10))
    x = random_input((5, H), "cpu", torch.float16, seed=11)
    weights, ids = reference.topk_route(random_input((5, E), "cpu", torch.float32, seed=12), 2)
    compiled = torch.compile(mod, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x, ids, weights), mod(x, ids, weights))


def test_plan_is_rebuilt_when_the_buffers_change():
    # A cached plan must not keep serving weights that a load or an in-place edit replaced.
    experts = random_experts(seed=13)
    mod = WQExperts.from_experts(experts)
    x = random_input((3, H), "cpu", torch.float16, seed=14)
    ids, w = torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.full((3, 2), 0.5)
    first = mod(x, ids, w)
    assert mod._plan.backend == "torch"
    other = WQExperts.from_experts(random_experts(seed=15))
    mod.load_state_dict(other.state_dict())
    torch.testing.assert_close(mod(x, ids, w), other(x, ids, w), rtol=0, atol=0)
    mod.w2_scales.mul_(2)
    assert not torch.equal(mod(x, ids, w), other(x, ids, w))
    assert not torch.equal(first, other(x, ids, w))
