"""Training configuration: YAML validated with pydantic, presets, ``--set key=value`` overrides.

An unknown key or a bad value raises ``ValueError`` naming the dotted key
(``train.stpes: unknown key``), every problem of a config on one line. Types are strict:
``true`` is not an integer, ``1.5`` is not an integer, numbers must be finite, and a YAML
file with a key given twice is refused. Beyond the schema, :func:`build_config` checks the
recipe overrides, the task's options and size, and the tiny models' shapes
(:mod:`trajgrad.train.config_checks`) before any model is built; :func:`load_config`
also refuses keys the user set that have no effect in the chosen mode. The recipe
section names one of ``trajgrad.objective.RECIPES``; ``recipe.overrides`` changes any of
its fields, and ``trajgrad explain CONFIG.yaml`` prints the resulting estimator.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from typing_extensions import Annotated

from ..objective import Objective, get_recipe


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)


class LoraConfig(_Strict):
    r: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: Optional[List[str]] = Field(
        None, description="modules to adapt; None = detected for the architecture (q/k/v/o_proj where the model "
        "has them, else peft's defaults for its type, else every linear layer but the head)")


class TinyModelConfig(_Strict):
    hidden_size: int = Field(96, ge=8)
    layers: int = Field(2, ge=1)
    heads: int = Field(4, ge=1)
    seed: int = 0


class ModelConfig(_Strict):
    """The policy: a named preset (``name``) or any Hugging Face causal LM (``path``).

    ``path``: a local checkpoint directory (config, weights, tokenizer with a chat
    template) or a hub id in the local Hugging Face cache (never downloaded); it wins over
    ``name``. ``lora: null`` trains every parameter (full fine-tuning).
    """

    name: Literal["smollm2", "tiny"] = Field("smollm2", description="built-in model (ignored when path is set)")
    path: Optional[str] = Field(None, description="checkpoint directory or hub id in the local HF cache")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="base weights; auto = bfloat16 only where the hardware computes it natively "
        "(AVX512-BF16/AMX CPUs, CUDA), else float32 (bf16 is emulated and slower on AVX2-only CPUs)")
    lora: Optional[LoraConfig] = LoraConfig()
    tiny: TinyModelConfig = TinyModelConfig()
    gradient_checkpointing: bool = False


class TaskConfig(_Strict):
    """The task: a registered source (``calculator``, ``guess``, ``openenv``, ``dataset``), a
    factory ``"package.module:factory"`` (a task source, or a gymnasium / verifiers
    environment, adapted), or a dataset with reward functions (``dataset`` + ``reward``)."""

    name: str = Field("calculator", description="a registered task source, or 'package.module:factory'")
    options: Dict[str, Any] = {}
    dataset: Optional[str] = Field(None, description="prompts: a .jsonl/.json/.parquet file or a datasets "
                                   "directory (sets task.name 'dataset')")
    reward: Optional[Union[str, List[str], Dict[str, float]]] = Field(
        None, description="reward functions of task.dataset: 'module:function', a list, or {'module:function': weight}")
    heldout: Optional[Union[float, str]] = Field(
        None, description="held-out rows of task.dataset: a fraction in [0, 1) or a file/directory (default 0.1, "
        "or the DatasetDict's test split)")
    n_train: int = Field(4000, ge=1)
    n_heldout: int = Field(64, ge=1)
    seed: int = 0
    shaping: bool = False

    @model_validator(mode="after")
    def _dataset_alias(self) -> "TaskConfig":
        # task.dataset / task.reward / task.heldout are the options of the "dataset" source;
        # inconsistent combinations are left as given and reported by config_checks with their keys
        if self.dataset is None or self.reward is None or self.name not in ("calculator", "dataset"):
            return self
        # task.name left at 'calculator': the calculator's options (e.g. a preset's) do not apply
        given = self.options if self.name == "dataset" else {}
        merged = {**given, "path": self.dataset, "reward": self.reward}
        if self.heldout is not None:
            merged["heldout"] = self.heldout
        if any(k in given and given[k] != merged[k] for k in ("path", "reward", "heldout")):
            return self
        self.__dict__["name"] = "dataset"
        self.__dict__["options"] = merged
        return self


class SamplingConfig(_Strict):
    temperature: float = Field(1.0, ge=0)
    top_k: Optional[int] = Field(None, ge=1)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    max_new_tokens: int = Field(48, ge=1)
    behaviour_temperature: Optional[float] = Field(
        None, gt=0, description="mismatch injection, for experiments only: the sampler draws (and records its "
        "behaviour log-probs) at this temperature while the learner recomputes at sampling.temperature, so "
        "pi_old != mu by design (bench/bench_mismatch.py); None = sample at sampling.temperature")

    @property
    def sampler_temperature(self) -> float:
        """The temperature the rollout sampler draws at (``behaviour_temperature`` when set)."""
        return self.temperature if self.behaviour_temperature is None else self.behaviour_temperature


class ProxyConfig(_Strict):
    """``rollout.backend: proxy``: the agent run per episode against the served policy (trajgrad.train.proxy)."""

    agent: Optional[str] = Field(None, description="a shell command (OPENAI_BASE_URL, TRAJGRAD_SESSION, TRAJGRAD_TASK "
                                 "in its environment) or 'package.module:function'")
    reward_timeout_s: float = Field(300.0, gt=0, description="an episode without a reward this long after its "
                                    "agent started is expired (its process killed): counted, never trained")
    concurrency: int = Field(8, ge=1, description="agent episodes run at once (their calls are batched)")


class VLLMConfig(_Strict):
    """``rollout.backend: vllm``: the vLLM server trajgrad starts and stops (trajgrad.rollout.vllm_server)."""

    python: Optional[str] = Field(None, description="the interpreter that has vLLM; None = .venv-vllm/bin/python "
                                  "(make vllm)")
    startup_timeout_s: float = Field(600.0, gt=0, description="seconds to wait for the server's /health")
    max_model_len: Optional[int] = Field(None, ge=16, description="--max-model-len; None = the model's")
    kv_cache_gb: float = Field(1.0, gt=0, description="VLLM_CPU_KVCACHE_SPACE (CPU build: GiB of KV cache)")
    extra_args: List[str] = Field([], description="more server arguments, appended verbatim")
    restarts: int = Field(1, ge=0, description="a server that dies mid-run is restarted this many times from the "
                          "last synced weights; the next death ends the run")


class RolloutConfig(_Strict):
    """Where rollouts come from: in-process Hugging Face sampling, an OpenAI-compatible server, a vLLM
    server trajgrad runs, or an external agent through the chat proxy."""

    backend: Literal["hf", "openai", "vllm", "proxy"] = "hf"
    base_url: Optional[str] = Field(None, description="server URL for backend 'openai' (or 'vllm': attach to that "
                                    "running vLLM server instead of starting one), e.g. http://127.0.0.1:8000")
    server: Literal["trajgrad", "vllm", "sglang"] = Field(
        "trajgrad", description="the dialect of backend 'openai': trajgrad serve, a running vLLM server (tested "
        "against vLLM 0.32's CPU build), or SGLang (untested: no SGLang build was run against it)")
    model_name: Optional[str] = Field(None, description="model name the server serves (default: the model's name)")
    template_mismatch: Literal["error", "truncate"] = Field(
        "error", description="when the chat template re-renders the history differently from the sampled tokens: "
        "error = raise, truncate = end the episode as truncated (counted; never trained)")
    proxy: ProxyConfig = ProxyConfig()
    vllm: VLLMConfig = VLLMConfig()


class RecipeConfig(_Strict):
    name: str = "grpo"
    overrides: Dict[str, Any] = {}


class OptimConfig(_Strict):
    lr: float = Field(5e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: Optional[float] = Field(1.0, gt=0)
    betas: List[Annotated[float, Field(ge=0, lt=1)]] = Field([0.9, 0.999], min_length=2, max_length=2,
                                                            description="Adam (beta1, beta2), each in [0, 1)")


class LoopConfig(_Strict):
    steps: int = Field(30, ge=0)
    prompts_per_step: int = Field(8, ge=1)
    group_size: Optional[int] = Field(None, ge=1, description="rollouts per prompt; None = the recipe's")
    micro_batch_size: int = Field(8, ge=1)
    epochs_per_batch: int = Field(1, ge=1)
    seed: int = 0
    old_logp: Literal["auto", "recompute", "behaviour"] = Field(
        "auto", description="auto: a single on-policy epoch uses the update pass's own detached log-probs "
        "(identical to a recompute); recompute: a separate no-grad pass; behaviour: the sampler's records")
    dynamic_sampling_max_tries: int = Field(3, ge=1)
    skip_zero_gradient_rows: bool = Field(
        True, description="rows whose loss and gradient are exactly zero (all advantages 0 under a policy term that "
        "vanishes with them, no KL or entropy term in the loss) run forward only, without a backward pass: the same "
        "update, metrics and logs; false differentiates every row")
    keep_freed_mb: int = Field(512, ge=0, description="MiB of freed memory the process keeps for the next step "
                               "(glibc mallopt; train/allocator.py); 0 = the C library's defaults")


class SFTConfig(_Strict):
    steps: int = Field(0, ge=0)
    batch_size: int = Field(16, ge=1)
    lr: float = Field(1e-3, gt=0)


class EvalConfig(_Strict):
    every: int = Field(10, ge=0)
    n: Optional[int] = Field(None, ge=1, description="held-out tasks to evaluate; None = task.n_heldout")
    during_n: Optional[int] = Field(None, ge=1, description="evaluations during training use the first during_n "
                                    "of those tasks (a quicker look); None = all")
    temperature: float = Field(0.0, ge=0)
    before: bool = True
    after: bool = True


class CriticConfig(_Strict):
    lr: float = Field(1e-3, gt=0)
    path: Optional[str] = Field(None, description="the critic's own backbone from a checkpoint directory or a cached "
                                "hub id (same tokenizer as the policy; trained with the value head at critic.lr); "
                                "None = a value head on the policy's hidden states")
    updates: Optional[int] = Field(None, ge=1, description="critic updates per actor update; None = the recipe's")
    warmup_steps: int = Field(0, ge=0)


class ConstraintConfig(_Strict):
    enabled: bool = False
    budget: float = 0.0
    lr: float = Field(0.05, gt=0)
    init: float = Field(0.0, ge=0)


class TeacherConfig(_Strict):
    name: Literal["smollm2", "tiny", "sft"] = "sft"
    path: Optional[str] = Field(None, description="the teacher from a checkpoint directory or a cached hub id "
                                "(same tokenizer as the policy); wins over name")
    tiny: TinyModelConfig = TinyModelConfig(seed=1)


class ReferenceConfig(_Strict):
    """pi_ref of the KL term and of DPO (§9, §10)."""

    path: Optional[str] = Field(None, description="a frozen reference model from a checkpoint directory or a cached "
                                "hub id (same tokenizer as the policy); None = the policy as RL starts")


class DPOConfig(_Strict):
    pairs: int = Field(64, ge=1)


class AsyncConfig(_Strict):
    """Single-rollout asynchronous optimization on Ray (§20): see ``trajgrad.train.asynchronous``."""

    enabled: bool = False
    workers: int = Field(2, ge=1, description="rollout actors")
    max_lag: int = Field(2, ge=0, description="max learner version minus oldest sampling version of a trajectory")
    batch_trajectories: int = Field(8, ge=1, description="trajectories per learner update")
    queue_size: int = Field(32, ge=1, description="bound of the finished-trajectory queue")
    partial: Literal["per_segment", "newest_segment", "discard_mixed"] = "per_segment"
    ray_address: Optional[str] = Field(None, description="join an existing Ray cluster; None = a local one")
    env_latency: Optional[Dict[str, float]] = Field(
        None, description="lognormal per-step latency {'mu': ..., 'sigma': ...} in log-seconds (benchmarks)")


class CheckpointConfig(_Strict):
    every: int = Field(10, ge=0)
    keep: int = Field(2, ge=1)


class LogConfig(_Strict):
    tensorboard: bool = True
    progress: bool = True
    token_log: bool = Field(True, description="per-token sidecar log tokens.jsonl (advantages, ratios, clip and "
                            "correction masks, log-probs, entropy) for `trajgrad view`; docs/view.md")
    token_log_max_mb: float = Field(64.0, gt=0, le=1_000_000, description="tokens.jsonl stops growing at this size "
                                    "(a last line marks the step it stopped at)")
    # experiment trackers next to metrics.jsonl (the source of truth); see trajgrad.train.tracking
    backends: List[Literal["jsonl", "tensorboard", "wandb", "mlflow", "trackio"]] = Field(
        ["jsonl"], description="metric sinks; jsonl is always written. wandb runs offline (WANDB_MODE=offline), "
        "mlflow logs to run_dir/mlruns, trackio to run_dir/trackio")
    project: str = Field("trajgrad", min_length=1, description="project / experiment name in wandb, mlflow, trackio")


class DistConfig(_Strict):
    """Learners under ``torchrun`` (see trajgrad.train.fsdp)."""

    fsdp: bool = Field(False, description="shard the decoder layers of a fully fine-tuned policy with FSDP2 "
                       "(needs model.lora: null); LoRA adapters stay replicated with summed gradients")


class Config(_Strict):
    name: str = Field("run", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$", description="names the run directory")
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    sampling: SamplingConfig = SamplingConfig()
    rollout: RolloutConfig = RolloutConfig()
    recipe: RecipeConfig = RecipeConfig()
    optim: OptimConfig = OptimConfig()
    train: LoopConfig = LoopConfig()
    sft: SFTConfig = SFTConfig()
    eval: EvalConfig = EvalConfig()
    critic: CriticConfig = CriticConfig()
    constraint: ConstraintConfig = ConstraintConfig()
    teacher: TeacherConfig = TeacherConfig()
    reference: ReferenceConfig = ReferenceConfig()
    dpo: DPOConfig = DPOConfig()
    asynchronous: AsyncConfig = AsyncConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()
    dist: DistConfig = DistConfig()

    def objective(self) -> Objective:
        """The recipe with the config's overrides (group size from ``train.group_size``)."""
        overrides = dict(self.recipe.overrides)
        if self.train.group_size is not None:
            overrides["group_size"] = self.train.group_size
        obj = get_recipe(self.recipe.name, **overrides)
        if obj.aggregation == "seq_sum_constant" and "constant" not in self.recipe.overrides:
            # Dr. GRPO's constant: the generation budget of one episode.
            obj = obj.replace(constant=float(self.sampling.max_new_tokens * _max_turns_hint(self)))
        return obj


def _max_turns_hint(cfg: Config) -> int:
    return int(cfg.task.options.get("max_turns", 4))


# ---------------------------------------------------------------------- presets (their own module)
from .presets import PRESETS  # noqa: E402


def _deep_update(base: Dict[str, Any], upd: Dict[str, Any]) -> Dict[str, Any]:
    for k, v in upd.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict) and k not in ("options", "overrides"):
            _deep_update(base[k], v)
        elif isinstance(v, dict) and isinstance(base.get(k), dict):
            base[k] = {**base[k], **v}
        else:
            base[k] = v
    return base


def _set_dotted(d: Dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    cur = d
    for p in parts[:-1]:
        if p not in cur or not isinstance(cur[p], dict):
            cur[p] = {}
        cur = cur[p]
    cur[parts[-1]] = value


def _format_error(exc: ValidationError) -> str:
    msgs = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()))
        if err.get("type") == "extra_forbidden":
            msgs.append(f"{loc}: unknown key")
        else:
            msg = str(err.get("msg", "")).removeprefix("Value error, ").rstrip(".")
            given = repr(err.get("input"))
            msgs.append(f"{loc}: {msg} (got {given if len(given) <= 60 else given[:57] + '...'})")
    return " ".join("; ".join(dict.fromkeys(msgs)).split())


def build_config(data: Dict[str, Any]) -> Config:
    """Validate ``data`` (schema, then :func:`trajgrad.train.config_checks.check_config`)."""
    from .config_checks import check_config

    if not isinstance(data, dict):
        raise ValueError(f"config: expected a mapping of sections, got {type(data).__name__}")
    try:
        cfg = Config.model_validate(data)
    except ValidationError as exc:
        raise ValueError(_format_error(exc)) from None
    check_config(cfg)
    return cfg


def _check_unique_keys(node, path: str, what: str) -> None:
    """Refuse a YAML mapping that gives a key twice (``yaml.safe_load`` keeps the last silently)."""
    if isinstance(node, yaml.MappingNode):
        seen = set()
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            dotted = f"{path}.{key}" if path else str(key)
            if key is not None:
                if key in seen:
                    raise ValueError(f"{dotted}: given twice in {what} (line {key_node.start_mark.line + 1})")
                seen.add(key)
            _check_unique_keys(value_node, dotted, what)
    elif isinstance(node, yaml.SequenceNode):
        for k, item in enumerate(node.value):
            _check_unique_keys(item, f"{path}.{k}" if path else str(k), what)


def parse_yaml(text: str, *, what: str) -> Any:
    """YAML ``text`` (safe types only) or ValueError naming ``what``; a key given twice is refused,
    naming its dotted path."""
    try:
        _check_unique_keys(yaml.compose(text, Loader=yaml.SafeLoader), "", what)
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ValueError(" ".join(f"{what}: invalid YAML{where}: {problem}".split())) from None


_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")


def parse_overrides(items) -> Dict[str, Any]:
    """``["train.steps=3", ...]`` -> ``{"train.steps": 3}``; values are YAML.

    Raises ValueError naming the key for a missing ``=``, a malformed dotted key, a key given
    twice, or a value that is not valid YAML.
    """
    out: Dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"--set: expected key=value, got {item!r}")
        key, value = item.split("=", 1)
        key = key.strip()
        if not _DOTTED.match(key):
            raise ValueError(f"--set: {key!r} is not a dotted key such as train.steps")
        if key in out:
            raise ValueError(f"{key}: given twice with --set")
        clash = [k for k in out if k.startswith(key + ".") or key.startswith(k + ".")]
        if clash:
            raise ValueError(f"{key}: overlaps {clash[0]} (both given with --set)")
        out[key] = parse_yaml(value, what=key)
    return out


def load_config(
    path: Optional[Path | str] = None,
    *,
    preset: Optional[str] = None,
    overrides: Optional[Dict[str, Any]] = None,
) -> Config:
    """Preset (``default`` when neither a path nor a preset is given) ← YAML file ← overrides.

    Every key set by the YAML file or the overrides is also checked for effect
    (:func:`trajgrad.train.config_checks.check_effective`).
    """
    from .config_checks import check_effective, user_keys

    if preset is not None and preset not in PRESETS:
        raise ValueError(f"preset: unknown {preset!r}; known: {', '.join(PRESETS)}")
    data: Dict[str, Any] = {}
    if preset is not None or path is None:
        data = copy.deepcopy(PRESETS[preset or "default"])
    named = False  # whether the YAML file or the overrides set the run's name
    keys = []
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ValueError(f"config: no such file {str(p)!r}")
        if p.is_dir():
            raise ValueError(f"config: {str(p)!r} is a directory, not a YAML file")
        try:
            text = p.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"config: cannot read {str(p)!r} ({exc})") from None
        loaded = parse_yaml(text, what=f"config {p}") or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config: top level of {p} must be a mapping")
        if "preset" in loaded:
            base = loaded.pop("preset")
            if not isinstance(base, str) or base not in PRESETS:
                raise ValueError(f"preset: unknown {base!r}; known: {', '.join(PRESETS)}")
            data = _deep_update(copy.deepcopy(PRESETS[base]), data)
        bad = [k for k, v in loaded.items() if k != "name" and not isinstance(v, dict)]
        if bad:
            raise ValueError(f"{bad[0]}: expected a mapping of keys (a section), got {loaded[bad[0]]!r}")
        keys += user_keys(loaded)
        named = "name" in loaded
        recipe_before = (data.get("recipe") or {}).get("name")
        data = _fresh_task_options(data, loaded.get("task"))
        data = _deep_update(data, loaded)
        if not named:
            data["name"] = _renamed(data.get("name"), recipe_before, (data.get("recipe") or {}).get("name"))
    # a preset's name ends with its recipe ("tiny-calculator-grpo"); changing the recipe
    # (`--set recipe.name=ppo`, or in the YAML file) renames the run unless a name was given
    recipe_before = (data.get("recipe") or {}).get("name")
    for key, value in (overrides or {}).items():
        if key == "task.name" and value != (data.get("task") or {}).get("name") and "task.options" not in (overrides or {}):
            data = _fresh_task_options(data, {"name": value})
        _set_dotted(data, key, value)
        keys += user_keys(value, key)
    if not named and "name" not in (overrides or {}):
        data["name"] = _renamed(data.get("name"), recipe_before, (data.get("recipe") or {}).get("name"))
    cfg = build_config(data)
    check_effective(cfg, keys)
    return cfg


def _fresh_task_options(data, task_update):
    """A different task starts from its own defaults: the base's ``task.options`` belonged to the
    base's task (a preset's calculator options mean nothing to ``my_pkg:make``)."""
    if isinstance(task_update, dict) and "name" in task_update and "options" not in task_update:
        task = data.get("task") or {}
        if task.get("name") != task_update["name"] and task.get("options"):
            data = dict(data, task=dict(task, options={}))
    return data


def _renamed(name, recipe_before, recipe_after):
    """``name`` with its ``-<recipe>`` suffix following a recipe change (preset names end with it)."""
    if (isinstance(name, str) and isinstance(recipe_before, str) and isinstance(recipe_after, str)
            and recipe_after != recipe_before and name.endswith(f"-{recipe_before}")):
        return name[: -len(recipe_before)] + recipe_after
    return name


def register_preset(name: str, data: Dict[str, Any]) -> None:
    """Add a preset (validated now, so a broken preset fails at import, not at run time)."""
    build_config(copy.deepcopy(data))
    PRESETS[name] = data
