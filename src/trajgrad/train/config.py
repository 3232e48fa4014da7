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

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator
from typing_extensions import Annotated

from ..objective import Objective, get_recipe
from ._dotted import set_dotted
from .config_checks import check_config, check_effective, user_keys
from .config_yaml import parse_overrides, parse_yaml  # noqa: F401  (parse_overrides: part of this module's API)
from .presets import PRESETS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)


class LoraConfig(_Strict):
    r: int = Field(8, ge=1, description="LoRA rank of each adapted module")
    alpha: float = Field(16.0, gt=0, description="LoRA scaling numerator (the update is scaled by alpha / r)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the LoRA branch's input")
    target_modules: Optional[List[str]] = Field(
        None, description="modules to adapt; None = detected for the architecture (q/k/v/o_proj where the model "
        "has them, else peft's defaults for its type, else every linear layer but the head)")


class TinyModelConfig(_Strict):
    """A randomly initialized small Llama-shaped model (tests, the tiny presets)."""

    hidden_size: int = Field(96, ge=8, description="width; divisible by heads with an even head size")
    layers: int = Field(2, ge=1, description="decoder layers")
    heads: int = Field(4, ge=1, description="attention heads")
    seed: int = Field(0, description="seed of the random initialization")


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
    lora: Optional[LoraConfig] = Field(LoraConfig(), description="LoRA adapters on the policy; null = full "
                                       "fine-tuning (every parameter trained)")
    tiny: TinyModelConfig = Field(TinyModelConfig(), description="the tiny model's shape (model.name 'tiny')")
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward pass "
                                         "(less training memory, more compute)")


class TaskConfig(_Strict):
    """The task: a registered source (``calculator``, ``guess``, ``openenv``, ``dataset``), a
    factory ``"package.module:factory"`` (a task source, or a gymnasium / verifiers
    environment, adapted), or a dataset with reward functions (``dataset`` + ``reward``)."""

    name: str = Field("calculator", description="a registered task source, or 'package.module:factory'")
    options: Dict[str, Any] = Field({}, description="the task source's options (free-form; checked against the "
                                    "source's options at load time; see the task.options sections below)")
    dataset: Optional[str] = Field(None, description="prompts: a .jsonl/.json/.parquet file or a datasets "
                                   "directory (sets task.name 'dataset')")
    reward: Optional[Union[str, List[str], Dict[str, float]]] = Field(
        None, description="reward functions of task.dataset: 'module:function', a list, or {'module:function': weight}")
    heldout: Optional[Union[float, str]] = Field(
        None, description="held-out rows of task.dataset: a fraction in [0, 1) or a file/directory (default 0.1, "
        "or the DatasetDict's test split)")
    n_train: int = Field(4000, ge=1, description="training tasks drawn from the source's train split; each pass "
                         "over them takes a fixed random order (task.seed), train.prompts_per_step per step")
    n_heldout: int = Field(64, ge=1, description="held-out tasks evaluated before and after training (eval.n wins)")
    seed: int = Field(0, description="seed of the task draws of both splits and of the training prompts' order")
    shaping: bool = Field(False, description="potential-based reward shaping from the environment's potentials "
                          "(r + gamma * Phi(s') - Phi(s), terminal potential 0; spec §21)")

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


class EnvironmentConfig(TaskConfig):
    """One environment of a run with several (``tasks:``; :mod:`trajgrad.train.mixture`): the keys of
    ``task:`` (``source`` is what ``task.name`` names there) plus its name, weight, group size and
    advantage overrides."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$", description="the environment's name in the "
                      "run (metrics env/<name>/..., trajectories, trajgrad view); unique")
    source: Optional[str] = Field(None, description="its task source, as task.name: a registered source or "
                                  "'package.module:factory'; None = name (or 'dataset' with dataset)")
    weight: float = Field(1.0, gt=0, description="share of each step's prompts (weights are normalized)")
    group_size: Optional[int] = Field(None, ge=1, description="rollouts per prompt; None = the run's")
    advantage: Dict[str, Any] = Field({}, description="this environment's overrides of the advantage "
                                      "estimator's fields (advantage, std_eps, std_unbiased, dynamic_sampling)")

    @model_validator(mode="after")
    def _dataset_alias(self) -> "EnvironmentConfig":
        return self  # the dataset alias applies to task_config()

    def task_config(self) -> TaskConfig:
        """This environment as a ``task:`` section (``source`` as its name)."""
        source = self.source or ("dataset" if self.dataset is not None else self.name)
        return TaskConfig.model_validate({**{k: getattr(self, k) for k in TaskConfig.model_fields}, "name": source})


class SamplingConfig(_Strict):
    """How rollouts are sampled from the policy."""

    temperature: float = Field(1.0, ge=0, description="rollout sampling temperature; the learner's log-probs are "
                               "computed at the same temperature (0 = greedy, log-probs at 1)")
    top_k: Optional[int] = Field(None, ge=1, description="sample among the k most likely tokens (log-probs of the "
                                 "truncated distribution); None = off")
    top_p: Optional[float] = Field(None, gt=0, le=1, description="nucleus sampling mass (log-probs of the truncated "
                                   "distribution); None = off")
    max_new_tokens: int = Field(48, ge=1, description="tokens generated per assistant turn; a turn that reaches it "
                                "is cut at the limit")
    behaviour_temperature: Optional[float] = Field(
        None, gt=0, description="mismatch injection, for experiments only: the sampler draws (and records its "
        "behaviour log-probs) at this temperature while the learner recomputes at sampling.temperature, so "
        "pi_old != mu by design (bench/bench_mismatch.py); None = sample at sampling.temperature")

    @property
    def sampler_temperature(self) -> float:
        """The temperature the rollout sampler draws at (``behaviour_temperature`` when set)."""
        return self.temperature if self.behaviour_temperature is None else self.behaviour_temperature


class ProxyConfig(_Strict):
    """``rollout.backend: proxy``: the agent run per episode against the served policy (trajgrad.serve.proxy)."""

    agent: Optional[str] = Field(None, description="a shell command (OPENAI_BASE_URL, TRAJGRAD_SESSION, TRAJGRAD_TASK "
                                 "in its environment) or 'package.module:function'")
    reward_timeout_s: float = Field(300.0, gt=0, description="an episode without a reward this long after its "
                                    "agent started is expired (its process killed): counted, never trained")
    concurrency: int = Field(8, ge=1, description="agent episodes run at once (their calls are batched)")
    engine: Literal["inprocess", "vllm"] = Field(
        "inprocess", description="what samples the agent's calls: inprocess = the live policy in this process; "
        "vllm = a vLLM server (rollout.vllm, or the one at rollout.base_url), synced after every update")


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

    backend: Literal["hf", "openai", "vllm", "proxy"] = Field(
        "hf", description="hf = in-process sampling with the policy; openai = an OpenAI-compatible server at "
        "base_url; vllm = a vLLM server this run starts and owns (rollout.vllm; make vllm), or attaches to at "
        "base_url; proxy = an external agent (rollout.proxy.agent) talking to the served policy")
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
    """The objective: a named recipe of ``trajgrad.objective.RECIPES`` and fields changed."""

    name: str = Field("grpo", description="a recipe name (trajgrad explain NAME prints its objective)")
    overrides: Dict[str, Any] = Field({}, description="recipe fields to change (see the recipe.overrides section); "
                                      "a field the recipe does not read is refused unless given its off value")


class OptimConfig(_Strict):
    """The policy's AdamW optimizer."""

    lr: float = Field(5e-4, gt=0, description="AdamW learning rate of the policy (RL steps)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    grad_clip: Optional[float] = Field(1.0, gt=0, description="clip the policy gradient's global norm to this; "
                                       "None = no clipping")
    betas: List[Annotated[float, Field(ge=0, lt=1)]] = Field([0.9, 0.999], min_length=2, max_length=2,
                                                            description="Adam (beta1, beta2), each in [0, 1)")


class LoopConfig(_Strict):
    """The RL loop: steps, batch shape, old log-probs, no-signal checks."""

    steps: int = Field(30, ge=0, description="RL optimizer steps (after the SFT warm start)")
    prompts_per_step: int = Field(8, ge=1, description="training prompts per step (each sampled group_size times)")
    group_size: Optional[int] = Field(None, ge=1, description="rollouts per prompt; None = the recipe's")
    micro_batch_size: int = Field(8, ge=1, description="rows per forward/backward pass; the loss's denominator "
                                  "is the whole batch's, so the update does not depend on it (§13)")
    epochs_per_batch: int = Field(1, ge=1, description="optimizer steps on each sampled batch (> 1: off-policy "
                                  "epochs, ratios against the old log-probs)")
    seed: int = Field(0, description="seed of the token draws of each step, of evaluation and of the DPO pairs")
    no_signal_steps: int = Field(3, ge=1, description="consecutive steps without a learning signal (every group "
                                 "with equal rewards; for single-rollout and critic recipes, equal rewards over the "
                                 "batch) after which a warning is printed and signal/no_signal_warning logged")
    stop_on_no_signal: bool = Field(False, description="end the run after train.no_signal_steps steps without a "
                                    "learning signal, with that message (checkpoint, evaluation after, summary.json "
                                    "'stopped'; trajgrad train exits with status 3), instead of only warning")
    old_logp: Literal["auto", "recompute", "behaviour"] = Field(
        "auto", description="auto: a single on-policy epoch uses the update pass's own detached log-probs "
        "(identical to a recompute); recompute: a separate no-grad pass; behaviour: the sampler's records")
    dynamic_sampling_max_tries: int = Field(3, ge=1, description="dynamic sampling (DAPO): rounds of resampling "
                                            "groups with equal rewards before training on what there is")
    skip_zero_gradient_rows: bool = Field(
        True, description="rows whose loss and gradient are exactly zero (all advantages 0 under a policy term that "
        "vanishes with them, no KL or entropy term in the loss) run forward only, without a backward pass: the same "
        "update, metrics and logs; false differentiates every row")
    keep_freed_mb: int = Field(512, ge=0, description="MiB of freed memory the process keeps for the next step "
                               "(glibc mallopt; runtime/allocator.py); 0 = the C library's defaults")


class SFTConfig(_Strict):
    """Supervised warm start on the task's demonstrations, before RL."""

    steps: int = Field(0, ge=0, description="SFT steps on demonstrations before RL (0 = none; the task must "
                       "provide demonstrations)")
    batch_size: int = Field(16, ge=1, description="demonstrations per SFT step")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate of the SFT warm start")


class EvalConfig(_Strict):
    """Held-out evaluation (success rate with its 95% Wilson interval)."""

    every: int = Field(10, ge=0, description="evaluate every this many RL steps (0 = only before and after)")
    n: Optional[int] = Field(None, ge=1, description="held-out tasks to evaluate; None = task.n_heldout")
    during_n: Optional[int] = Field(None, ge=1, description="evaluations during training use the first during_n "
                                    "of those tasks (a quicker look); None = all")
    temperature: float = Field(0.0, ge=0, description="sampling temperature of evaluation (0 = greedy)")
    before: bool = Field(True, description="evaluate before training (and after the SFT warm start)")
    after: bool = Field(True, description="evaluate after training; with before, prints the two-proportion test")
    distinct: Literal["refuse", "warn"] = Field(
        "refuse", description="when more held-out tasks are asked for than the task has distinct prompts (after "
        "rendering): refuse at load, or warn and evaluate only the distinct ones")


class CriticConfig(_Strict):
    """The value function of critic recipes (PPO, SAO)."""

    lr: float = Field(1e-3, gt=0, description="AdamW learning rate of the critic")
    path: Optional[str] = Field(None, description="the critic's own backbone from a checkpoint directory or a cached "
                                "hub id (same tokenizer as the policy; trained with the value head at critic.lr); "
                                "None = a value head on the policy's hidden states")
    updates: Optional[int] = Field(None, ge=1, description="critic updates per actor update; None = the recipe's")
    warmup_steps: int = Field(0, ge=0, description="first steps that train only the critic (no policy update)")


class ConstraintConfig(_Strict):
    """A cost constraint by a Lagrange multiplier (§22): rewards become r - lambda * cost."""

    enabled: bool = Field(False, description="subtract lambda times the environment's info['cost'] per turn (with "
                          "the lagrangian policy term: the term applies lambda to the cost advantages instead)")
    budget: float = Field(0.0, description="the cost budget d: lambda grows while the mean episode cost exceeds it")
    lr: float = Field(0.05, gt=0, description="dual ascent step of lambda (projected to >= 0)")
    init: float = Field(0.0, ge=0, description="lambda at the start")


class TeacherConfig(_Strict):
    """The teacher of on-policy distillation (recipes gkd, opd)."""

    name: Literal["smollm2", "tiny", "sft"] = Field(
        "sft", description="smollm2 = the embedded model; tiny = a random tiny model (smoke test); sft = a tiny "
        "model trained on demonstrations for max(50, 2 * sft.steps) steps")
    path: Optional[str] = Field(None, description="the teacher from a checkpoint directory or a cached hub id "
                                "(same tokenizer as the policy); wins over name")
    tiny: TinyModelConfig = Field(TinyModelConfig(seed=1), description="the tiny teacher's shape")


class ReferenceConfig(_Strict):
    """pi_ref of the KL term and of DPO (§9, §10)."""

    path: Optional[str] = Field(None, description="a frozen reference model from a checkpoint directory or a cached "
                                "hub id (same tokenizer as the policy); None = the policy as RL starts")


class DPOConfig(_Strict):
    """Preference pairs of the dpo recipe, sampled once from the initial policy."""

    pairs: int = Field(64, ge=1, description="training tasks sampled twice each to form the preference pairs")


class AsyncConfig(_Strict):
    """Single-rollout asynchronous optimization on Ray (§20): see ``trajgrad.train.asynchronous``."""

    enabled: bool = Field(False, description="rollouts on Ray actors while the learner trains (§20)")
    workers: int = Field(2, ge=1, description="rollout actors")
    max_lag: int = Field(2, ge=0, description="max learner version minus oldest sampling version of a trajectory")
    batch_trajectories: int = Field(8, ge=1, description="trajectories per learner update")
    queue_size: int = Field(32, ge=1, description="bound of the finished-trajectory queue")
    partial: Literal["per_segment", "newest_segment", "discard_mixed"] = Field(
        "per_segment", description="episodes sampled by several policy versions: per_segment = every token's "
        "ratio against its own version; newest_segment = train only the newest version's tokens; discard_mixed "
        "= drop them (train/partial.py)")
    ray_address: Optional[str] = Field(None, description="join an existing Ray cluster; None = a local one")
    env_latency: Optional[Dict[str, float]] = Field(
        None, description="lognormal per-step latency {'mu': ..., 'sigma': ...} in log-seconds (benchmarks)")


class CheckpointConfig(_Strict):
    """Checkpoints in the run directory (trajgrad train --resume continues from them)."""

    every: int = Field(10, ge=0, description="save a checkpoint every this many steps and at the end (0 = none)")
    keep: int = Field(2, ge=1, description="checkpoints kept (older ones are deleted)")


class LogConfig(_Strict):
    """Metrics (metrics.jsonl, always), trackers, the per-token log, the console."""

    tensorboard: bool = Field(True, description="also write TensorBoard events (as 'tensorboard' in backends)")
    progress: bool = Field(True, description="progress bars on the console")
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
    """A training run (``trajgrad train``): every section below."""

    name: str = Field("run", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$", description="names the run directory")
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    tasks: Optional[List[EnvironmentConfig]] = Field(
        None, min_length=1, description="several environments in one run, instead of task (trajgrad.train.mixture)")
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

    # the objective built from this config and the settings it was built from (Config.objective)
    _built_objective: Optional[tuple] = PrivateAttr(default=None)

    def objective(self) -> Objective:
        """The recipe with the config's overrides (group size from ``train.group_size``).

        Built and checked once: the checks at load time, ``explain``, the trainer and the
        asynchronous learners get the same :class:`Objective`; it is built again only when a
        setting it reads (recipe name and overrides, group size, generation budget) changed.
        """
        inputs = (self.recipe.name, copy.deepcopy(self.recipe.overrides), self.train.group_size,
                  self.sampling.max_new_tokens, _max_turns_hint(self))
        if self._built_objective is not None and self._built_objective[0] == inputs:
            return self._built_objective[1]
        overrides = dict(self.recipe.overrides)
        if self.train.group_size is not None:
            overrides["group_size"] = self.train.group_size
        obj = get_recipe(self.recipe.name, **overrides)
        if obj.aggregation == "seq_sum_constant" and "constant" not in self.recipe.overrides:
            # Dr. GRPO's constant: the generation budget of one episode.
            obj = obj.replace(constant=float(self.sampling.max_new_tokens * _max_turns_hint(self)))
        self._built_objective = (inputs, obj)
        return obj


def _max_turns_hint(cfg: Config) -> int:
    return int(cfg.task.options.get("max_turns", 4))


def _deep_update(base: Dict[str, Any], upd: Dict[str, Any]) -> Dict[str, Any]:
    for k, v in upd.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict) and k not in ("options", "overrides"):
            _deep_update(base[k], v)
        elif isinstance(v, dict) and isinstance(base.get(k), dict):
            base[k] = {**base[k], **v}
        else:
            base[k] = v
    return base


def _format_error(exc: ValidationError) -> str:
    msgs = []
    for err in exc.errors():
        loc = re.sub(r"^tasks\.(\d+)", r"tasks[\1]", ".".join(str(x) for x in err.get("loc", ())))
        if err.get("type") == "extra_forbidden":
            msgs.append(f"{loc}: unknown key")
        else:
            msg = str(err.get("msg", "")).removeprefix("Value error, ").rstrip(".")
            given = repr(err.get("input"))
            msgs.append(f"{loc}: {msg} (got {given if len(given) <= 60 else given[:57] + '...'})")
    return " ".join("; ".join(dict.fromkeys(msgs)).split())


def build_config(data: Dict[str, Any]) -> Config:
    """Validate ``data`` (schema, then :func:`trajgrad.train.config_checks.check_config`)."""
    if not isinstance(data, dict):
        raise ValueError(f"config: expected a mapping of sections, got {type(data).__name__}")
    if data.get("tasks") is not None and not _default_task(data.get("task")):
        raise ValueError(_BOTH_TASK_KEYS)
    try:
        cfg = Config.model_validate(data)
    except ValidationError as exc:
        raise ValueError(_format_error(exc)) from None
    check_config(cfg)
    return cfg


_BOTH_TASK_KEYS = ("task, tasks: both given; give task (one environment) or tasks (several, each with the keys "
                   "of a task plus name, weight, group_size, advantage), not both")


def _default_task(task) -> bool:
    """Whether a ``task`` section is absent or all defaults (what a dumped config with ``tasks`` holds)."""
    if task is None:
        return True
    try:
        return TaskConfig.model_validate(task) == TaskConfig()
    except ValidationError:
        return False


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
        bad = [k for k, v in loaded.items() if k not in ("name", "tasks") and not isinstance(v, dict)]
        if bad:
            raise ValueError(f"{bad[0]}: expected a mapping of keys (a section), got {loaded[bad[0]]!r}")
        keys += user_keys(loaded)
        named = "name" in loaded
        recipe_before = (data.get("recipe") or {}).get("name")
        data = _fresh_task_options(data, loaded.get("task"))
        data = _deep_update(data, loaded)
        if not named and "name" in data:
            data["name"] = _renamed(data.get("name"), recipe_before, (data.get("recipe") or {}).get("name"))
    # a preset's name ends with its recipe ("tiny-calculator-grpo"); changing the recipe
    # (`--set recipe.name=ppo`, or in the YAML file) renames the run unless a name was given
    recipe_before = (data.get("recipe") or {}).get("name")
    for key, value in (overrides or {}).items():
        if key == "task.name" and value != (data.get("task") or {}).get("name") and "task.options" not in (overrides or {}):
            data = _fresh_task_options(data, {"name": value})
        set_dotted(data, key, value)
        keys += user_keys(value, key)
    if data.get("tasks") is not None:  # several environments: a preset's task section is not the user's
        if any(k == "task" or k.startswith("task.") for k in keys):
            raise ValueError(_BOTH_TASK_KEYS)
        data.pop("task", None)
    if not named and "name" not in (overrides or {}) and "name" in data:
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
