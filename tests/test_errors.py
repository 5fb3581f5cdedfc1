"""Bad configs and bad requests get a clear error that names the field, never a stack trace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark.config import ConfigError, SamplingParams
from dspark.evaluation.prompt_sets import prompt_set_path
from dspark.schema import load_engine_config, read_yaml, sampling_from_values
from dspark.training.recipe import TrainFileConfig

from conftest import REPO, make_engine


@pytest.mark.parametrize(("values", "field"), [
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -1}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"nucleus": 0.9}, "nucleus"),
    # the bounds every front door shares (issue 19: these restarted a replica or the drafter)
    ({"top_k": 2**63}, "top_k"),
    ({"seed": 2**64 - 1}, "seed"),
    ({"temperature": 50.0}, "temperature"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["a"] * 9}, "stop"),
])
def test_bad_sampling_values_name_the_field(values, field):
    with pytest.raises(ConfigError) as info:
        sampling_from_values(**values)
    assert info.value.field == field


def test_core_dataclass_refuses_bad_values_too():
    with pytest.raises(ConfigError, match="top_p"):
        SamplingParams(top_p=0)
    for field, value in (("top_k", 2**63), ("seed", 2**63), ("temperature", 2.5), ("stop", ("",))):
        with pytest.raises(ConfigError) as info:
            SamplingParams(**{field: value})
        assert info.value.field == field


def test_a_vanishing_temperature_decodes_greedily(tiny_target, tiny_tokenizer):
    """Logits divided by 1e-38 overflow; below GREEDY_BELOW a request is greedy (it sampled token 0 before)."""
    engine = make_engine(tiny_target, tiny_tokenizer)
    prompt = tiny_tokenizer.encode("def fibonacci(n):")
    greedy, tiny = (engine.generate([prompt], SamplingParams(max_tokens=12, temperature=t, ignore_eos=True))[0]
                    for t in (0.0, 1e-38))
    assert SamplingParams(temperature=1e-38).greedy and not SamplingParams(temperature=1e-3).greedy
    assert tiny.token_ids == greedy.token_ids and len(set(greedy.token_ids)) > 1


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "engine.yaml"
    path.write_text(text)
    return path


def test_unknown_and_bad_config_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"engine\.max_num_seqz"):
        load_engine_config(write_config(tmp_path, "target: {path: x}\nengine: {max_num_seqz: 4}\n"))
    with pytest.raises(ConfigError, match=r"engine\.verification"):
        load_engine_config(write_config(tmp_path, "target: {path: x}\nengine: {verification: greedy}\n"))
    with pytest.raises(ConfigError, match=r"target"):
        load_engine_config(write_config(tmp_path, "engine: {}\n"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_engine_config(write_config(tmp_path, "target: [\n"))


def test_every_config_in_the_repo_validates():
    configs = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    assert configs
    for path in configs:
        if path.name.startswith("train-") and "distill" in path.name:
            from dspark.training.recipe import DistillFileConfig

            DistillFileConfig(**read_yaml(path))
        elif path.name.startswith("train-"):
            TrainFileConfig(**read_yaml(path))
        elif path.name.startswith("serve"):  # a Ray Serve config file: Serve's own schema, and the app builds
            from ray.serve.schema import ServeDeploySchema

            from deploy.ray_app import build_app

            serve_config = ServeDeploySchema.model_validate(read_yaml(path))
            for application in serve_config.applications:
                module, _, attr = application.import_path.partition(":")
                assert module == "deploy.ray_app" and attr in ("app", "build_app")
                build_app(application.args or {})
        else:
            load_engine_config(path)


def test_prompt_longer_than_context_is_refused(tiny_target, tiny_tokenizer):
    engine = make_engine(tiny_target, tiny_tokenizer, max_model_len=32)
    with pytest.raises(ConfigError) as info:
        engine.add_request(list(range(40)), SamplingParams(max_tokens=4))
    assert info.value.field == "prompt"
    with pytest.raises(ConfigError) as info:
        engine.add_request(list(range(20)), SamplingParams(max_tokens=20))
    assert info.value.field == "max_tokens"
    with pytest.raises(ConfigError, match="prompt"):
        engine.add_request([], SamplingParams(max_tokens=4))
    with pytest.raises(ConfigError, match="prompt"):
        engine.add_request([10**6], SamplingParams(max_tokens=4))


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory, tiny_target_dir, tiny_draft_dir) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "tiny.yaml"
    path.write_text(f"name: tiny\ntarget: {{path: {tiny_target_dir}, dtype: float64}}\n"
                    f"draft: {{path: {tiny_draft_dir}, dtype: float64}}\n"
                    "engine: {max_model_len: 256, kv_cache_tokens: 4096, profile_max_tokens: 8}\n")
    return path


def dspark_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "dspark.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_cli_generate_json_speculative_equals_no_spec(tiny_config):
    common = ["generate", "--config", str(tiny_config), "--prompt", "def main():", "--max-tokens", "24",
              "--temperature", "0", "--json"]
    spec, plain = dspark_cli(*common), dspark_cli(*common, "--no-spec")
    assert spec.returncode == 0, spec.stderr
    a, b = json.loads(spec.stdout), json.loads(plain.stdout)
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) > 0
    assert a["metrics"]["num_drafts"] > 0 and b["metrics"]["num_drafts"] == 0
    for key in ("acceptance_length", "acceptance_length_per_request", "accepted_per_pos", "verify_steps",
                "completion_tokens", "num_draft_tokens", "num_accepted_tokens"):
        assert key in a["metrics"]
    assert isinstance(a["text"], str)


def test_cli_chat_and_sampled_seeded_runs_repeat(tiny_config):
    args = ["generate", "--config", str(tiny_config), "--prompt", "hello", "--chat", "--max-tokens", "16",
            "--temperature", "1.0", "--top-p", "0.95", "--seed", "7", "--json"]
    first, second = dspark_cli(*args), dspark_cli(*args)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["token_ids"] == json.loads(second.stdout)["token_ids"]


@pytest.mark.parametrize(("flags", "field"), [
    (["--max-tokens", "-1"], "max_tokens"),
    (["--top-p", "1.5"], "top_p"),
    (["--max-tokens", "100000"], "max_tokens"),
])
def test_cli_reports_bad_flags_by_name(tiny_config, flags, field):
    out = dspark_cli("generate", "--config", str(tiny_config), "--prompt", "x", *flags)
    assert out.returncode == 2
    assert field in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(("flags", "field"), [
    (["--lr", "-0.001"], "train.lr"),
    (["--steps", "0"], "train.steps"),
    (["--set", "draft.block_size=0"], "draft.block_size"),
    (["--set", "data.engine=sglang"], "data.engine"),
    (["--set", "train.run_name=../elsewhere"], "train.run_name"),
    (["--set", "draft.block_size"], "--set"),
    (["--set", "draft.block_size.deeper=1"], "--set"),
])
def test_cli_train_overrides_are_validated_by_name(flags, field):
    out = dspark_cli("train", "--config", str(REPO / "configs" / "train-smollm2.yaml"), "--stages", "train", *flags)
    assert out.returncode == 2
    assert field in out.stderr and "Traceback" not in out.stderr


def test_cli_reports_bad_config_by_name(tmp_path):
    bad = write_config(tmp_path, "target: {path: /nowhere}\nengine: {kv_cache_tokenz: 3}\n")
    out = dspark_cli("generate", "--config", str(bad), "--prompt", "x")
    assert out.returncode == 2 and "kv_cache_tokenz" in out.stderr and "Traceback" not in out.stderr
    missing = write_config(tmp_path, "target: {path: /nowhere}\n")
    out = dspark_cli("generate", "--config", str(missing), "--prompt", "x")
    assert out.returncode == 2 and "target.path" in out.stderr


def test_cli_bench_writes_results_table_and_plot(tiny_config, tmp_path):
    out, plot = tmp_path / "results.json", tmp_path / "acceptance.png"
    dataset = prompt_set_path("mbpp")
    run = dspark_cli("bench", "--config", str(tiny_config), "--dataset", str(dataset), "--limit", "2",
                     "--max-tokens", "12", "--out", str(out), "--plot", str(plot), "--baseline-dtypes", "float64")
    assert run.returncode == 0, run.stderr
    results = json.loads(out.read_text())
    spec = results["benchmarks"]["mbpp"]["speculative"]
    assert spec["prompts"] == 2 and spec["completion_tokens"] > 0 and spec["verify_steps"] > 0
    assert len(spec["acceptance_rate_per_pos"]) <= results["block_size"]
    assert sum(spec["acceptance_histogram"]) == spec["num_drafts"]
    requests = spec["requests"]  # each request's own summary, as the server returns it; the pooled figures add up
    assert len(requests) == 2 and sum(r["accepted_tokens"] for r in requests) == spec["num_accepted_tokens"]
    assert sum(r["verify_steps"] for r in requests) == spec["verify_steps"]
    assert sum(r["acceptance_length"] for r in requests) / 2 == pytest.approx(spec["acceptance_length_per_request"])
    assert results["benchmarks"]["mbpp"]["speedup"] > 0 and set(spec["time_split_s"]) >= {"draft", "verify"}
    assert "| mbpp | 2 |" in results["markdown"] and "**Pooled**" in run.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_app_builder_validates_its_arguments_and_config(tmp_path, monkeypatch):
    from deploy.ray_app import DEFAULT_CONFIG, build_app, deployment_options

    with pytest.raises(ConfigError, match="build_app: bogus"):
        build_app({"bogus": 1})
    with pytest.raises(ConfigError, match="no such file"):
        build_app({"config": str(tmp_path / "missing.yaml")})
    bad = tmp_path / "bad.yaml"
    bad.write_text("target: {path: /x}\nserving: {max_concurrent_requests: 0}\n")
    with pytest.raises(ConfigError, match="serving.max_concurrent_requests"):
        build_app({"config": str(bad)})
    monkeypatch.setenv("DSPARK_CONFIG", str(bad))  # the environment variable overrides the default
    with pytest.raises(ConfigError, match="serving.max_concurrent_requests"):
        build_app()
    monkeypatch.delenv("DSPARK_CONFIG")
    config = load_engine_config(DEFAULT_CONFIG)
    options = deployment_options(config)  # the shipped default: vLLM's engine computes in the replica process
    assert options["placement_group_bundles"] == [{"CPU": config.serving.router_cpus + config.runtime.shard_cpus}]
    assert options["placement_group_strategy"] == "STRICT_PACK"
    native = deployment_options(config.model_copy(update={"engine": config.engine.model_copy(
        update={"backend": "native"})}))  # the replica, then a target shard actor and the drafter actor
    assert native["placement_group_bundles"][0] == {"CPU": 0.5} and len(native["placement_group_bundles"]) == 3
    # omp_wait_policy 'auto': vLLM's engine in the replica keeps libgomp's own spinning (docs/performance.md, "The
    # served vLLM path"); shard and drafter actors wait briefly; an explicit policy holds on either backend
    env = options["ray_actor_options"]["runtime_env"]["env_vars"]
    assert not {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & set(env) and env["OMP_NUM_THREADS"]
    assert config.runtime.actor_env() == {"GOMP_SPINCOUNT": "20000", "KMP_BLOCKTIME": "1"}
    brief = config.model_copy(update={"runtime": config.runtime.model_copy(update={"omp_wait_policy": "brief"})})
    assert deployment_options(brief)["ray_actor_options"]["runtime_env"]["env_vars"]["GOMP_SPINCOUNT"] == "20000"
