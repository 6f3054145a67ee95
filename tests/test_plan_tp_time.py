"""`ddpkit plan` with a tensor degree: the split layers' activation collectives (read from the model and
its plan on fake tensors, `ddpkit.plan.tp_time`) on the tensor group's link, beside the data dimensions'
collectives of 1/T of the gradients. On a slow tensor link (PCIe-class) the step grows with the tensor
degree, on a fast one (NVLink-class) it falls: compute divides by T, the activations' all-reduces do not."""

from __future__ import annotations

import json

import pytest
import torch

from ddpkit.plan import links, tp_time
from ddpkit.plan.profile import Param, Profile
from ddpkit.plan.simulate import Cluster, Options, step
from ddpkit.tools import workloads

GPT_PLAN = {
    "blocks.*.qkv": "colwise",
    "blocks.*.proj": "rowwise",
    "blocks.*.mlp.0": "colwise",
    "blocks.*.mlp.2": "rowwise",
}
UNIT = 16 << 20


def test_each_block_all_reduces_its_activations_once_forward_and_once_backward_per_pair() -> None:
    """The named GPT (4 blocks, d 256, 128 tokens): per block, the attention's and the MLP's row-wise
    outputs all-reduced forward, their column-wise inputs' gradients backward; with sequence
    parallelism each becomes a reduce-scatter and an all-gather of the same bytes."""
    wl = workloads.NAMED["gpt"]
    model = wl.build()
    x, _ = wl.sample(torch.Generator().manual_seed(0), 1)
    act = float(x.numel() * model.tok.embedding_dim * 4)  # one sample's residual stream, fp32
    blocks = len(model.blocks)
    fwd, bwd = tp_time.collectives("gpt", GPT_PLAN, degree=2)
    assert fwd == (("allreduce", act),) * (2 * blocks)
    assert bwd == (("allreduce", act),) * (2 * blocks)
    sfwd, sbwd = tp_time.collectives("gpt", GPT_PLAN, degree=2, sequence_parallel=True)
    assert sorted(sfwd) == sorted((("allgather", act), ("reduce_scatter", act)) * (2 * blocks))
    assert sum(b for _, b in sfwd) == 2 * sum(b for _, b in fwd) and len(sbwd) == len(sfwd)


def _profile() -> Profile:
    params = tuple(
        Param(name=f"u{i}", shape=(UNIT // 4,), bytes=UNIT, ready_s=0.02 * (i + 1)) for i in range(4)
    )
    return Profile(
        workload="synthetic",
        device="cuda",
        threads=1,
        batch=8,
        forward_s=0.04,
        backward_s=0.08,
        optimizer_s=0.004,
        copy_s=0.001,
        params=params,
        state_bytes=0,
    )


def _link(beta: float) -> links.Link:
    intra = links.Level(name="in", alpha_s=5e-6, beta_Bps=beta, source="test")
    return links.Link(name="one node", intra=intra, inter=None, nics_per_node=1)


ACT = ((("allreduce", 4 << 20),) * 8, (("allreduce", 4 << 20),) * 8)  # 8 layers of 4 MiB per sample


def _tp(t: int, beta: float) -> float:
    cluster = Cluster(n=8, per_node=8, link=_link(beta), algorithm="ring")
    opts = Options(strategy="tp", tensor=t, tp_forward=ACT[0], tp_backward=ACT[1])
    return step(_profile(), cluster, opts).step_s


def test_the_step_grows_with_the_tensor_degree_on_a_slow_link_and_falls_on_a_fast_one() -> None:
    slow = [_tp(t, 2e9) for t in (2, 4, 8)]  # 2 GB/s: a PCIe-class link
    fast = [_tp(t, 400e9) for t in (2, 4, 8)]  # 400 GB/s: NVLink-class
    assert slow[0] < slow[1] < slow[2], slow
    assert fast[0] > fast[1] > fast[2], fast
    cluster = Cluster(n=8, per_node=8, link=_link(2e9), algorithm="ring")
    two = step(_profile(), cluster, Options(strategy="tp", tensor=2, tp_forward=ACT[0], tp_backward=ACT[1]))
    group = Cluster(n=2, per_node=8, link=_link(2e9), algorithm="ring")
    tp_comm = 16 * group.allreduce(8 * (4 << 20))[0]  # 16 all-reduces of a micro-batch's activations
    assert two.comm_s > tp_comm > 0 and two.exposed_s >= tp_comm
    assert two.comm_s - tp_comm == pytest.approx(
        step(
            _profile(),
            Cluster(n=4, per_node=4, link=_link(2e9), algorithm="ring"),
            Options(strategy="fsdp"),
        ).comm_s
        / 2,
        rel=0.05,
    )  # the data dimensions move half the bytes
    assert two.options["tensor"] == 2 and two.options["tp_collectives"]["count"] == 16


def _cli(capsys, tmp_path, *args: str) -> tuple[int, dict | str]:
    from ddpkit.plan import cli

    saved = tmp_path / "profiles.json"
    saved.write_text(json.dumps({"profiles": {"8": _profile().as_dict()}}))
    base = [
        "--workload",
        "gpt",
        "--profile",
        str(saved),
        "--batch-size",
        "8",
        "--link",
        "pcie4",
        "--json",
        "-",
    ]
    code = cli.main([*base, *args])
    out = capsys.readouterr()
    return code, json.loads(out.out) if code == 0 else out.err


def test_plan_with_a_tensor_degree_reports_its_flags_and_collectives(capsys, tmp_path) -> None:
    tp_args = ["--strategy", "tp", "--tensor-degree", "2", "--tp-plan", json.dumps(GPT_PLAN)]
    code, plan = _cli(capsys, tmp_path, *tp_args, "--counts", "1,2,4,8")
    assert code == 0 and isinstance(plan, dict), plan
    assert plan["options"]["strategy"] == "tp" and plan["options"]["tensor"] == 2
    assert plan["tensor"]["tensor_degree"] == 2 and len(plan["tensor"]["forward"]) == 8
    assert [r["n"] for r in plan["curve"]] == [1, 2, 4, 8]
    code, seq = _cli(capsys, tmp_path, *tp_args, "--sequence-parallel", "--counts", "1,2")
    assert code == 0 and isinstance(seq, dict) and seq["options"]["tensor"] == 2
    assert {c["kind"] for c in seq["tensor"]["forward"]} == {"allgather", "reduce_scatter"}


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            ["--strategy", "tp", "--tensor-degree", "2", "--counts", "1,3"],
            "do not split into tensor groups of 2",
        ),
        (["--strategy", "fsdp", "--tensor-degree", "2"], "tensor parallelism's, not fsdp's"),
        (["--strategy", "tp", "--tensor-degree", "2"], "no tensor-parallel plan of its own"),
    ],
    ids=["counts", "fsdp", "no-plan"],
)
def test_plan_refuses_a_tensor_degree_that_cannot_work(capsys, tmp_path, args: list[str], says: str) -> None:
    code, err = _cli(capsys, tmp_path, *args)
    assert code == 2 and isinstance(err, str) and says in err, err


LLAMA = (
    "hf:llama,hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,"
    "num_key_value_heads=2,vocab_size=256,max_position_embeddings=64"
)


def test_a_llama_by_its_own_plan_reduces_each_shared_input_once() -> None:
    """LlamaForCausalLM's own plan at 64 tokens, d 64, vocabulary 256: forward, the embedding's
    row-wise lookup and each layer's o_proj and down_proj all-reduced, the head's logits gathered;
    backward, one all-reduce per column-wise input (q, k and v read one tensor, gate and up another)."""
    fwd, bwd = tp_time.collectives(LLAMA, "auto", degree=2)
    act = 64 * 64 * 4.0
    assert sorted(fwd) == sorted((("allreduce", act),) * (1 + 2 * 2) + (("allgather", 64 * 256 * 4.0),))
    assert bwd == (("allreduce", act),) * (2 * 2 + 1)


def test_on_shared_cores_every_rank_of_every_tensor_group_competes_for_them() -> None:
    """CPU ranks on one machine of 2 cores: TP(2) on 4 ranks computes half the step at the speed of 4
    ranks on 2 cores (twice slower), not of the 2 data ranks the data-parallel part spans."""
    shared = links.Link(
        name="cpu",
        intra=links.Level(name="in", alpha_s=5e-6, beta_Bps=1e9, source="test"),
        shares_cores=True,
        cores=2,
    )
    cluster = Cluster(n=4, per_node=4, link=shared, algorithm="ring")
    got = step(_profile(), cluster, Options(strategy="tp", tensor=2, tp_forward=ACT[0], tp_backward=ACT[1]))
    assert got.forward_s == pytest.approx(_profile().forward_s / 2 * 2)
    assert got.backward_s == pytest.approx(_profile().backward_s / 2 * 2)


def test_on_cpu_ranks_each_activation_collective_adds_host_time_not_divided_by_t() -> None:
    """A CPU rank is its own host: DTensor's dispatch around every activation collective and the wait
    for the peer run in line with the compute, TP_HOST_CPU_S each, whatever the tensor degree; on
    CUDA the host runs ahead of the kernels and nothing is added."""
    from dataclasses import replace

    from ddpkit.plan.simulate import TP_HOST_CPU_S

    cluster = Cluster(n=2, per_node=8, link=_link(2e9), algorithm="ring")
    opts = Options(strategy="tp", tensor=2, tp_forward=ACT[0], tp_backward=ACT[1])
    gpu = step(_profile(), cluster, opts)
    cpu = step(replace(_profile(), device="cpu"), cluster, opts)
    assert cpu.step_s - gpu.step_s == pytest.approx(16 * TP_HOST_CPU_S)
    assert cpu.forward_s - gpu.forward_s == pytest.approx(8 * TP_HOST_CPU_S)
    assert cpu.comm_s == pytest.approx(gpu.comm_s)  # host time, not communication
    wide = Cluster(n=4, per_node=8, link=_link(2e9), algorithm="ring")
    t4 = replace(opts, tensor=4)
    added = step(replace(_profile(), device="cpu"), wide, t4).step_s - step(_profile(), wide, t4).step_s
    assert added == pytest.approx(16 * TP_HOST_CPU_S)  # the same at T = 4: not divided by T


def test_validation_rows_match_each_plan_to_the_benchmarks_measurement_by_strategy_and_batch() -> None:
    """benchmarks/tp_vs_fsdp.py's JSON against a TP(2) plan of global batch 64: one row against
    ddpkit's TP, one against torch's TP alone, each with the plan's error."""
    from ddpkit.plan import validate

    measured = {
        "ms_per_step": {
            "64": {
                "tp": {"median_ms": 80.0, "spread_ms": [72.0, 88.0]},
                "torch-tp": {"median_ms": 50.0, "spread_ms": [45.0, 55.0]},
            }
        }
    }
    plan = {
        "workload": "stack64",
        "options": {"strategy": "tp", "tensor": 2},
        "curve": [
            {"n": 1, "per_rank_batch": 64, "step_s": 0.04},
            {"n": 2, "per_rank_batch": 64, "step_s": 0.05},
        ],
    }
    rows = validate.side_by_side(measured, [plan])
    assert [(r["workload"], r["n"]) for r in rows] == [
        ("stack64 batch 64 TP(2)", 2),
        ("stack64 batch 64 torch's TP(2) alone", 2),
    ]
    assert rows[0]["plan"]["error"] == pytest.approx(50 / 80 - 1) and rows[0]["spread"] == pytest.approx(0.2)
    assert rows[1]["plan"]["error"] == pytest.approx(0.0)
    assert "50.0 (+0%)" in validate.markdown(rows, ["plan"])
