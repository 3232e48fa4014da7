"""The ``trajgrad`` command line: train | config | doctor | explain | verify | example | plot | serve | view.

Each command reaches its subsystem through the package (``trajgrad.train.run.main``, ...), whose
subpackages load on first use (``trajgrad._LAZY``): ``trajgrad --help`` imports none of them.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import List, Optional

import torch
import typer

import trajgrad

from ._optional import MissingPackage

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="trajgrad: exact, gradient-proven RL for LLM agents. Every update's objective is printable.",
)


def _parse_sets(sets: Optional[List[str]]) -> dict:
    """``--set key=value`` items (values are YAML); ValueError naming the key otherwise."""
    return trajgrad.train.config.parse_overrides(sets)


def _fail(exc: BaseException, code: int = 2) -> None:
    """Print ``error: <one line>`` to stderr and exit with status ``code`` (no traceback)."""
    typer.echo("error: " + " ".join(str(exc).split()), err=True)
    raise typer.Exit(code)


@app.command()
def explain(
    recipe: Optional[str] = typer.Argument(None, help="Recipe name, or a training config YAML. Omit with --all."),
    all_: bool = typer.Option(False, "--all", help="Explain every recipe."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a recipe field: key=value (repeatable)."),
    diff: Optional[str] = typer.Option(None, "--diff", help="A second recipe or config: print the two term by term."),
    diff_set: Optional[List[str]] = typer.Option(None, "--diff-set", help="Override a field of the --diff side only: "
                                                 "key=value (repeatable; after --set, which applies to both)."),
) -> None:
    """Print the exact estimator a recipe (or a config) optimizes; with --diff, what differs between two."""
    objective = trajgrad.objective

    def resolve(name: str, overrides):
        if name.endswith((".yaml", ".yml")):
            return trajgrad.train.config.load_config(name, overrides=overrides).objective()
        return objective.get_recipe(name, **overrides)

    try:
        overrides = _parse_sets(set_)
        if diff_set and diff is None:
            raise ValueError("--diff-set: needs --diff (e.g. trajgrad explain cispo --diff cispo --diff-set "
                             "mask_eps_high=0.28)")
        if diff is not None:
            if recipe is None:
                raise ValueError("recipe: --diff needs two recipes or configs: trajgrad explain A --diff B")
            other = {**overrides, **_parse_sets(diff_set)}
            typer.echo(objective.explain_diff(resolve(recipe, overrides), resolve(diff, other)))
            return
        if all_ or recipe is None:
            names = list(objective.RECIPES)
            texts = [objective.explain(n) for n in names]
            typer.echo(("\n\n" + "=" * 78 + "\n\n").join(texts))
            return
        if recipe.endswith((".yaml", ".yml")):
            cfg = trajgrad.train.config.load_config(recipe, overrides=overrides)
            # with tasks: each environment's objective where they differ
            typer.echo(trajgrad.train.mixture.explain_config(cfg))
            return
        typer.echo(objective.explain(recipe, **overrides))
    except ValueError as exc:
        _fail(exc)


@app.command()
def verify(
    target: Optional[str] = typer.Argument(None, help="The loss to check: package.module:function or path/file.py:function."),
    as_: Optional[str] = typer.Option(None, "--as", help="Recipe whose reference loss to compare with (default grpo)."),
    peer: Optional[str] = typer.Option(None, "--peer", help="Check a peer library's own functions: trl or verl."),
    out: Path = typer.Option(Path("conformance"), "--out", help="With --peer: folder for the Markdown and HTML report."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a reference recipe field: key=value."),
    seed: int = typer.Option(0, help="Random seed of the test batches."),
    include_kl: bool = typer.Option(False, "--include-kl", help="Compare with the recipe's KL term too (ref_logp= passed)."),
) -> None:
    """Run the §24 battery and a value+gradient comparison of TARGET against trajgrad (--as logprobs: a log-prob function)."""
    if peer is not None:
        _verify_peer(peer, as_, out, seed)
        return
    as_ = as_ or "grpo"
    try:
        if target is None:
            raise ValueError("target: give MODULE:FUNCTION to check, or --peer trl|verl")
        fn = trajgrad.verify.load_callable(target)
        report = trajgrad.verify.verify(fn, as_, seed=seed, include_kl=include_kl, **_parse_sets(set_))
    except ValueError as exc:
        _fail(exc)
    typer.echo(f"verify {target} against recipe '{as_}' (float64)\n")
    typer.echo(report.table())
    raise typer.Exit(0 if report.passed else 1)


def _verify_peer(peer: str, recipe: Optional[str], out: Path, seed: int) -> None:
    peers = trajgrad.peers
    try:
        module = {"trl": peers.trl, "verl": peers.verl}.get(peer)
        if module is None:
            raise ValueError(f"--peer: must be trl or verl, got {peer!r}")
        try:
            version = importlib.import_module(peer).__version__
        except ImportError as exc:
            raise ValueError(f"--peer: {peer} is not installed ({exc}); install the pinned peers: "
                             f"pip install \"trajgrad[peers]\" (see the README)") from exc
        results = peers.conformance(peer, recipe=recipe, seed=seed)
    except ValueError as exc:
        _fail(exc)
    typer.echo(f"verify --peer {peer} ({peer} {version}; pinned {module.PINNED}) against trajgrad (float64)\n")
    typer.echo(peers.report.table(results))
    for path in peers.report.write(peer, version, results, out):
        typer.echo(f"wrote {path}")
    raise typer.Exit(0 if all(r.status.startswith("agrees") for r in results) else 1)


@app.command()
def example() -> None:
    """The spec's one-batch worked calculation (§23) through ppo_clip_loss."""
    old = torch.tensor([[-1.00, -0.50], [-0.20, -0.70]], dtype=torch.float64)
    cur = torch.tensor([[-0.90, -0.60], [-0.10, -1.00]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-0.5, -0.5]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])
    res = trajgrad.losses.ppo_clip_loss(cur, old, adv, mask, eps_low=0.2)
    res.loss.backward()
    ratios = torch.exp(cur.detach() - old)[mask.bool()]
    typer.echo("spec §23: two trajectories, two action tokens each, clip epsilon 0.2")
    typer.echo(f"  ratios at valid tokens : {[round(float(r), 5) for r in ratios]}")
    typer.echo(f"  loss (token mean)      : {float(res.loss.detach()):.5f}   (spec: -0.48581)")
    typer.echo(f"  d loss / d logp        : {cur.grad.tolist()}  (masked 4th token: 0)")
    typer.echo(f"  clip fraction          : {float(res.metrics.get('clip_frac', torch.tensor(0.0))):.3f}")


@app.command()
def train(
    config: Optional[Path] = typer.Argument(None, help="YAML config. Omit to train the embedded default."),
    preset: Optional[str] = typer.Option(None, "--preset", help="Named preset (default, tiny, ...)."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a config key: key=value (repeatable)."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue a killed run from its directory "
                                          "(with its own config; --set changes it only with --allow-config-change)."),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Where to write the run (default runs/<name>-<time>); "
                                           "must not hold a run already."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the run in --run-dir (a trajgrad run directory) "
                                   "instead of refusing it."),
    allow_config_change: bool = typer.Option(False, "--allow-config-change", help="With --resume: continue under a "
                                             "config that differs from the run's (the change is recorded in run.json)."),
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint", help="With --resume: continue from this checkpoint "
                                             "(step-NNNNNN) instead of the newest, e.g. when the newest is damaged."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="Asynchronous runs: join this Ray cluster."),
) -> None:
    """Train an agent (the embedded default: SmolLM2-135M + LoRA, calculator tool, GRPO)."""
    try:
        overrides = _parse_sets(set_)
        if ray_address is not None:
            if "asynchronous.ray_address" in overrides:
                raise ValueError("asynchronous.ray_address: given both with --ray-address and --set")
            overrides["asynchronous.ray_address"] = ray_address
        code = trajgrad.train.run.main(config=config, preset=preset, overrides=overrides, resume=resume, run_dir=run_dir,
                          overwrite=overwrite, allow_config_change=allow_config_change, checkpoint=checkpoint)
    except ValueError as exc:
        _fail(exc)
    except OSError as exc:  # a file system refusal (permissions, full disk, ...): one line, no traceback
        _fail(ValueError(f"{getattr(exc, 'filename', None) or 'run_dir'}: {exc.strerror or exc}"))
    except trajgrad.envs.TaskError as exc:  # the user's task code failed mid-run (a reward function, ...): one line
        _fail(exc, 1)
    raise typer.Exit(code or 0)


@app.command()
def config(
    config_file: Optional[Path] = typer.Argument(None, metavar="CONFIG", help="YAML config (omit: the default preset)."),
    preset: Optional[str] = typer.Option(None, "--preset", help="Named preset (default, tiny, ...)."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a config key: key=value (repeatable)."),
    schema: bool = typer.Option(False, "--schema", help="Print the JSON Schema of a config."),
    markdown: bool = typer.Option(False, "--markdown", help="Print the configuration reference (docs/config.md)."),
) -> None:
    """Print the resolved config with where each value came from (default, preset, file, --set)."""
    config_reference, config_sources = trajgrad.train.config_reference, trajgrad.train.config_sources
    try:
        if schema or markdown:
            if schema and markdown:
                raise ValueError("--schema: give one of --schema and --markdown")
            if config_file is not None or preset is not None or set_:
                raise ValueError("--schema: documents every key; it takes no CONFIG, --preset or --set")
            typer.echo(json.dumps(config_reference.json_schema(), indent=2) if schema else config_reference.markdown(),
                       nl=not markdown)
            return
        _, rows = config_sources.config_sources(config_file, preset=preset, overrides=_parse_sets(set_))
        typer.echo(config_sources.format_sources(rows))
    except ValueError as exc:
        _fail(exc)


@app.command()
def doctor(
    config_file: Optional[Path] = typer.Argument(None, metavar="CONFIG", help="YAML config (omit: the default preset)."),
    preset: Optional[str] = typer.Option(None, "--preset", help="Named preset (default, tiny, ...)."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a config key: key=value (repeatable)."),
    groups: int = typer.Option(16, "--groups", help="Groups (prompts) to sample at the recipe's group size."),
    max_seconds: Optional[float] = typer.Option(None, "--max-seconds", help="Time budget from the start (default "
                                                "120 for the tiny model, 300 otherwise)."),
    no_sft: bool = typer.Option(False, "--no-sft", help="Sample the policy before the configured SFT warm start."),
) -> None:
    """Will this run learn? Sample the base policy as training would; the recipe's signal, a verdict, advice.

    Exit status: 0 for ok (or n/a), 1 for a weak signal or none, 2 for a bad config."""
    try:
        facts = trajgrad.train.doctor.doctor(config_file, preset=preset, overrides=_parse_sets(set_), groups=groups,
                          max_seconds=max_seconds, sft=not no_sft, console=lambda m: typer.echo(m, err=True))
    except ValueError as exc:
        _fail(exc)
    text, verdict = trajgrad.train.doctor_report.format_report(facts)
    typer.echo(text)
    raise typer.Exit(1 if verdict in ("no signal", "weak signal") else 0)


@app.command()
def plot(run_dir: Path = typer.Argument(..., help="A run directory with metrics.jsonl.")) -> None:
    """Write PNG learning curves of a run."""
    try:
        paths = trajgrad.view.plot_run(run_dir)
    except ValueError as exc:
        _fail(exc)
    for p in paths:
        typer.echo(str(p))


@app.command()
def serve(
    model: str = typer.Option("tiny", "--model", help="tiny (random test model), smollm2 (SmolLM2-135M-Instruct), "
                              "or a Hugging Face checkpoint directory / cached hub id (loaded as model.path is)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to bind. No authentication: keep it on loopback."),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16 parameters (head in float32)."),
    adapter: Optional[Path] = typer.Option(None, "--adapter", help="A peft adapter directory to load at start."),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="Served model id (default trajgrad-<model>)."),
    policy_version: int = typer.Option(0, "--policy-version", help="Version reported before the first /reload."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed of the generator for unseeded requests."),
) -> None:
    """Serve a model over an OpenAI-compatible API with exact behaviour log-probs (docs/serving.md)."""
    try:
        trajgrad.serve.main(host=host, port=port, model=model, dtype=dtype,
                            adapter=None if adapter is None else str(adapter),
                   model_name=model_name, policy_version=policy_version, seed=seed)
    except ValueError as exc:
        _fail(exc)


@app.command()
def view(
    run_dir: Path = typer.Argument(..., help="A run directory (with trajectories.jsonl)."),
    out: Optional[Path] = typer.Option(None, "--out", help="HTML file to write (default RUN_DIR/view.html)."),
    serve: bool = typer.Option(False, "--serve", help="Serve the page on 127.0.0.1 instead (Ctrl-C stops); "
                               "episodes beyond the embedding cap load on demand."),
    port: int = typer.Option(8765, "--port", help="With --serve: the loopback port (0: any free one)."),
    max_episodes: int = typer.Option(5000, "--max-episodes", help="Newest trajectories listed on the page."),
    max_tokens: int = typer.Option(300_000, "--max-tokens", help="Tokens of token detail embedded (newest first)."),
    env: Optional[str] = typer.Option(None, "--env", help="Only this environment's episodes (a run with tasks:)."),
) -> None:
    """Write one self-contained HTML page over a run: episodes, coloured tokens, curves, objective (docs/view.md)."""
    try:
        if serve:
            trajgrad.view.serve_view(run_dir, port=port, max_episodes=max_episodes, max_tokens=max_tokens,
                                     console=typer.echo,
                       environment=env)
            return
        page = trajgrad.view.write_view(run_dir, out, max_episodes=max_episodes, max_tokens=max_tokens, environment=env)
        typer.echo(str(page))
    except ValueError as exc:
        _fail(exc)
    except OSError as exc:
        _fail(ValueError(f"{getattr(exc, 'filename', None) or 'out'}: {exc.strerror or exc}"))


def main() -> None:  # console script entry point
    # nothing is ever fetched at run time: keep Hugging Face libraries from trying (peft
    # looks up the base model's config online when it saves adapters)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        app()
    except MissingPackage as exc:  # a feature's optional package: one line naming the install command
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
