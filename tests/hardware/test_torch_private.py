"""Every private torch name anydevice uses, checked against the torch these tests run on.

``anydevice.hardware.backends.torch_private`` is the one place that touches them. A torch release
that renames or drops one fails here by name, before a user meets an ``AttributeError``
or a silently different answer.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

from anydevice.hardware.backends import torch_private as tp

CUDA_BUILD = torch.version.cuda is not None


@pytest.mark.parametrize("name", sorted(tp.NAMES))
def test_each_private_name_is_where_this_build_should_have_it(name: str) -> None:
    where, builds = tp.NAMES[name]
    present = hasattr(importlib.import_module(where), name)
    if builds == "all" or CUDA_BUILD:
        assert present, f"{where}.{name} is gone from torch {torch.__version__}"


def test_privateuse1_name_is_the_slots_name_before_and_after_a_rename() -> None:
    code = (
        "import torch\n"
        "from anydevice.hardware.backends.torch_private import privateuse1_name\n"
        "print(privateuse1_name())\n"
        "torch.utils.rename_privateuse1_backend('npuish')\n"
        "print(privateuse1_name())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["privateuseone", "npuish"]


def test_fp32_precision_nodes_read_back_what_was_stored() -> None:
    assert tp.has_fp32_precision_tree()
    before = tp.fp32_precision("mkldnn", "matmul")
    other = "tf32" if before == "ieee" else "ieee"
    try:
        tp.set_fp32_precision("mkldnn", "matmul", other)
        assert tp.fp32_precision("mkldnn", "matmul") == other
    finally:
        tp.set_fp32_precision("mkldnn", "matmul", before)
    assert tp.fp32_precision("mkldnn", "matmul") == before


def test_the_cuda_bindings_fall_back_on_a_build_without_them() -> None:
    if CUDA_BUILD:
        pytest.skip("a CUDA build: the bindings are there (checked above)")
    from anydevice.hardware.backends.cuda import cudnn_version_number, has_primary_context

    assert tp.primary_context_query() is None and tp.cudnn_binding() is None
    assert cudnn_version_number() is None
    assert has_primary_context(0) is False
    assert not torch.cuda.is_initialized()


def test_the_host_cache_is_emptied_through_the_public_name_where_torch_has_it() -> None:
    empty = tp.host_empty_cache()
    public = getattr(torch.accelerator, "empty_host_cache", None)
    assert empty is (public if public is not None else torch._C._host_emptyCache)


def test_process_groups_lists_the_default_group_and_the_ones_made_from_it(tmp_path) -> None:
    # In a child: a real one-rank gloo world, made and destroyed there.
    code = (
        "import torch.distributed as dist\n"
        "from anydevice.hardware.backends.torch_private import process_groups\n"
        "assert process_groups() == []\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, "
        "world_size=1)\n"
        "sub = dist.new_group([0])\n"
        "groups = process_groups()\n"
        "assert groups[0] is dist.group.WORLD and sub in groups and len(groups) == 2, groups\n"
        "dist.destroy_process_group()\n"
        "assert process_groups() == []\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_flight_record_counts_each_groups_collectives_and_names_the_last(tmp_path) -> None:
    # In a child: a real one-rank gloo world with a subgroup; again with the recorder off.
    code = (
        "import torch, torch.distributed as dist\n"
        "from anydevice.hardware.backends.torch_private import flight_record\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, "
        "world_size=1)\n"
        "sub = dist.new_group([0])\n"
        "t = torch.ones(3, dtype=torch.float64)\n"
        "dist.all_reduce(t); dist.all_reduce(t); dist.broadcast(t, 0, group=sub)\n"
        "status = flight_record(entries=False)['pg_status']\n"
        "print(sorted((k, v['last_enqueued_collective']) for k, v in status.items()))\n"
        "entries = flight_record(entries=True)['entries']\n"
        "last = entries[-1] if entries else {}\n"
        "print(last.get('profiling_name'), last.get('collective_seq_id'), "
        "last.get('input_sizes'), last.get('input_dtypes'), 'frames' in last)\n"
        "dist.destroy_process_group()\n"
    )
    for buffer, expected in (
        ("2000", ["[('0', 2), ('1', 1)]", "gloo:broadcast 1 [[3]] ['Double'] False"]),
        ("0", ["[]", "None None None None False"]),
    ):
        env = {**os.environ, "TORCH_FR_BUFFER_SIZE": buffer}
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env=env,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.splitlines() == expected, buffer


# ----------------------------------------------------------------------------- members


def test_every_private_name_says_what_anydevice_does_without_it() -> None:
    assert set(tp.FALLBACKS) == set(tp.NAMES)
    assert all(tp.FALLBACKS.values())
    assert all(m.fallback and m.use in ("override", "read", "write") for m in tp.MEMBERS)


@pytest.fixture(scope="module")
def torch_objects(tmp_path_factory):
    """Real objects of torch's, as anydevice meets them, for the private attributes their
    constructors set: an elastic agent (on a real rendezvous store on loopback), a
    compiled module, a sampler, a loader and its iterator, an ATen op."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.utils.data import DataLoader, RandomSampler

    from anydevice.launching import addressing, rendezvous
    from anydevice.launching.elastic import plan

    logs = str(tmp_path_factory.mktemp("logs"))
    with rendezvous.open_rendezvous(addressing.settle(plan(1)), 30) as handler:
        spec = WorkerSpec(
            role="default", local_world_size=1, entrypoint="true", rdzv_handler=handler
        )
        loader = DataLoader(range(4))
        yield {
            "LocalElasticAgent": LocalElasticAgent(spec, DefaultLogsSpecs(log_dir=logs)),
            "OptimizedModule": torch.compile(torch.nn.Linear(1, 1)),
            "RandomSampler": RandomSampler(range(4)),
            "DataLoader": loader,
            "_BaseDataLoaderIter": iter(loader),
            "OpOverload": torch.ops.aten.mm.default,
        }


@pytest.mark.parametrize("member", tp.MEMBERS, ids=lambda m: f"{m.owner}.{m.name}")
def test_each_private_member_is_where_anydevice_reads_or_overrides_it(member, torch_objects):
    """An override's method with the parameters the override takes (else the override is
    silently never called); an attribute on a real object of torch's."""
    owner = tp.lookup(member.where, member.owner)
    assert owner is not None, (
        f"{member.where}.{member.owner} is gone from torch {torch.__version__}"
    )
    if member.use == "override":
        method = getattr(owner, member.name, None)
        assert callable(method), f"{member.dotted} is gone from torch {torch.__version__}"
        assert tp._parameters(method) == member.params, f"{member.dotted} takes other parameters"
        assert tp.missing_overrides(owner) == ()
    else:
        holder = torch_objects.get(member.owner, owner)
        assert isinstance(holder, owner) or holder is owner
        assert hasattr(holder, member.name), (
            f"{member.dotted} is gone from torch {torch.__version__}"
        )


def test_an_override_whose_method_torch_renamed_is_named_with_its_fallback(caplog) -> None:
    """A torch whose agent calls ``_rendezvous`` something else, and whose ``_shutdown``
    takes other parameters: both overrides would never be called, and the launch says so."""

    class LocalElasticAgent:  # the class as such a torch would define it
        def _join(self, worker_group: object) -> None: ...

        def _invoke_run(self, role: str = "default") -> None: ...

        def _monitor_workers(self, worker_group: object) -> None: ...

        def _shutdown(self, signal: int = 15) -> None: ...

    gone = tp.missing_overrides(LocalElasticAgent)
    assert [m.name for m in gone] == ["_rendezvous", "_shutdown"]
    with caplog.at_level("WARNING", logger="anydevice"):
        tp.warn_missing_overrides(LocalElasticAgent)
    assert "has no _rendezvous(worker_group)" in caplog.text and "reach check" in caplog.text
    assert "has no _shutdown(death_sig, timeout)" in caplog.text and "grace" in caplog.text


def test_every_override_of_a_private_method_is_listed() -> None:
    """A method of ours named like a private one of torch's that calls it through
    ``super()`` is an override: it must be in MEMBERS, where a test checks torch has it."""
    import ast
    from pathlib import Path

    import anydevice

    listed = {m.name for m in tp.MEMBERS if m.use == "override"}
    found = set()
    for path in Path(anydevice.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("_"):
                for call in ast.walk(node):
                    if (
                        isinstance(call, ast.Attribute)
                        and call.attr == node.name
                        and isinstance(call.value, ast.Call)
                        and ast.unparse(call.value.func) == "super"
                        and not node.name.startswith("__")
                    ):
                        found.add(node.name)
    assert found == listed


def test_the_readers_fall_back_on_objects_without_the_private_names() -> None:
    """What anydevice does where a torch lacks each attribute: nothing read, nothing
    written, the stated fallback."""
    plain = object()
    assert tp.agent_processes(plain) is None and tp.agent_workers(plain) == []
    tp.stop_restarts(plain)  # nothing to write to
    assert tp.collective_timeout(plain) is None
    assert tp.compiled_inner(torch.nn.Linear(1, 1)) is None
    assert tp.random_sampler_size(plain) is None
    assert tp.loader_workers(iter([1])) == (None, False)
    assert tp.iterator_kept(plain) is False
    assert tp.overload_packet(len) is None


def test_the_readers_read_torchs_objects(torch_objects) -> None:
    from torch.utils.data import RandomSampler

    agent = torch_objects["LocalElasticAgent"]
    assert tp.agent_processes(agent) is None  # no worker started
    assert [w.local_rank for w in tp.agent_workers(agent)] == [0]
    tp.stop_restarts(agent)
    assert agent._remaining_restarts == 0
    compiled = torch_objects["OptimizedModule"]
    assert isinstance(tp.compiled_inner(compiled), torch.nn.Linear)
    assert tp.random_sampler_size(RandomSampler(range(4), num_samples=2)) == 2
    assert tp.random_sampler_size(torch_objects["RandomSampler"]) is None
    end, persistent = tp.loader_workers(torch_objects["_BaseDataLoaderIter"])
    assert end is None and persistent is False  # no worker processes
    assert tp.overload_packet(torch.ops.aten.mm.default) is torch.ops.aten.mm
    indices, values = tp.coo_parts(torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (3,)))
    assert indices.tolist() == [[0, 2]] and values.tolist() == [1.0, 2.0]


def test_a_process_groups_timeout_is_the_one_it_was_made_with(tmp_path) -> None:
    code = (
        "import datetime, torch.distributed as dist\n"
        "from anydevice.hardware.backends.torch_private import collective_timeout\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, "
        "world_size=1, timeout=datetime.timedelta(seconds=42))\n"
        "print(collective_timeout(dist.group.WORLD).total_seconds())\n"
        "dist.destroy_process_group()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0 and out.stdout.strip() == "42.0", out.stderr[-2000:]
