"""Train from a config: jrl train --config NAME [--set k=v ...].

--config takes the name of a config shipped in jrl.configs (`arith_tiny`, `gsm8k_qwen3_sync`,
...), a Python file defining get_config() -> RunConfig, or a JSON file of a RunConfig (a run's
own <workdir>/config.json: `--config runs/NAME/config.json` runs the same setup again).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

from jrl import logs, stop_request


def load_config(path: str, overrides: list[str]):
    """The RunConfig of a config file (*.json: the config as JSON, e.g. a run's config.json;
    any other file: Python defining get_config()), with the --set overrides applied.
    ValueError naming the file when it cannot be read as one."""
    from jrl import configs
    if not os.path.isfile(path):
        shipped = configs.path(path)
        if shipped is None:
            raise FileNotFoundError(f"--config {path!r}: no such file, and not the name of a "
                                    f"shipped config ({', '.join(configs.names())})")
        path = shipped
    from jrl.pipeline.config import RunConfig
    from jrl.pipeline.config.migration import migrate_overrides
    from jrl.pipeline.config.tools import apply_overrides
    config = _load_json_config(path) if path.endswith(".json") else _load_python_config(path)
    if not isinstance(config, RunConfig):
        raise ValueError(f"--config {path!r}: get_config() returned {type(config).__name__}; "
                         "it must return a jrl.pipeline.RunConfig")
    overrides, notes = migrate_overrides(overrides)
    for note in notes:
        print(f"--set: {note}", file=sys.stderr)
    config = apply_overrides(config, overrides)
    arch = [o.split("=", 1)[0] for o in overrides if o.startswith("model.arch.")]
    if arch and config.model.source != "random":
        raise ValueError(f"--set {arch[0]}: model.arch.* describes the model of model.source="
                         f"'random'; model.source={config.model.source!r} takes the architecture "
                         "from the checkpoint, so the override would be ignored")
    return config


def resolved_config_json(config) -> str:
    """The config a run would use, as JSON: the numerical contract resolved for this platform
    (what Run records in config.json)."""
    import dataclasses
    import json

    from jrl.pipeline.config.tools import to_dict
    config = dataclasses.replace(config, numerics=config.numerics.resolved_for())
    return json.dumps(to_dict(config), indent=1)


def section_help(name: str, config=None) -> str:
    """A config section's docstring and a table of its fields: name, type and value (config's,
    or the defaults'). The top level is "run". ValueError naming the sections for another name."""
    import dataclasses
    import inspect
    import typing

    from jrl.checks import check_choice
    from jrl.pipeline.config import RunConfig
    hints = typing.get_type_hints(RunConfig)
    sections = {f.name: hints[f.name] for f in dataclasses.fields(RunConfig)
                if dataclasses.is_dataclass(hints[f.name])}
    check_choice("--help-config", name, ["run", *sections])
    cls = RunConfig if name == "run" else sections[name]
    value = config if config is not None else None
    if value is not None and name != "run":
        value = getattr(config, name)
    lines = [f"{name}: {cls.__name__}", "", inspect.getdoc(cls) or "", "", "fields:"]
    field_hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if name == "run" and field.name in sections:
            continue
        if value is not None:
            current = getattr(value, field.name)
        elif field.default is not dataclasses.MISSING:
            current = field.default
        else:
            current = field.default_factory()
        kind = getattr(field_hints[field.name], "__name__", str(field_hints[field.name]))
        prefix = "" if name == "run" else f"{name}."
        lines.append(f"  {prefix}{field.name} ({kind}) = {current!r}")
    if name == "run":
        lines.append(f"sections (--help-config SECTION): {', '.join(sections)}")
    return "\n".join(lines)


def _load_json_config(path: str):
    from jrl.pipeline.config import config_from_dict
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        where = f" (line {err.lineno})" if isinstance(err, json.JSONDecodeError) else ""
        raise ValueError(f"--config {path!r}{where}: not readable as JSON: "
                         f"{type(err).__name__}: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"--config {path!r}: holds a JSON {type(data).__name__}, not the "
                         "object of a RunConfig")
    try:
        return config_from_dict(data, log=lambda note: print(f"--config {path!r}: {note}",
                                                             file=sys.stderr))
    except (ValueError, TypeError) as err:
        raise ValueError(f"--config {path!r}: {err}") from err


def _load_python_config(path: str):
    spec = importlib.util.spec_from_file_location("jrl_user_config", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:   # a user's file: any error is reported as one line naming it
        where = f" (line {err.lineno})" if isinstance(err, SyntaxError) and err.lineno else ""
        raise ValueError(f"--config {path!r}{where}: {type(err).__name__}: {err}") from err
    if not hasattr(module, "get_config"):
        raise ValueError(f"--config {path!r} defines no get_config()")
    try:
        return module.get_config()
    except Exception as err:
        raise ValueError(f"--config {path!r}: get_config() raised {type(err).__name__}: "
                         f"{err}") from err


def flatten_params(tree) -> dict:
    """{key path: numpy array} of a params tree (--dump-params' .npz entries)."""
    import jax
    import numpy as np
    return {jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _step_range(text: str) -> tuple[int, int]:
    """"A:B" (1 <= A <= B) as (A, B); one step "A" as (A, A)."""
    first, _, last = text.partition(":")
    try:
        steps = (int(first), int(last or first))
    except ValueError:
        steps = (0, 0)
    if not 1 <= steps[0] <= steps[1]:
        raise argparse.ArgumentTypeError(f"{text!r} is not A:B with 1 <= A <= B (RL steps)")
    return steps


def _export_target_problem(path: str) -> str | None:
    """Why an export directory cannot be written (checked before training, so a long run never
    ends on an export it cannot write), or None. A URL (jrl.paths): its scheme and filesystem
    package; whether the bucket takes writes shows at the export."""
    from jrl import paths
    if paths.is_url(path):
        if paths.exists(path) and not paths.isdir(path):
            return "exists and is a file, not a directory; give a new path"
        if paths.listdir(path):
            return "the directory exists and is not empty; give a new path"
        return None
    if os.path.exists(path):
        if not os.path.isdir(path):
            return "exists and is a file, not a directory; give a new path"
        if os.listdir(path):
            return "the directory exists and is not empty; give a new path"
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot create it: {parent} is not a writable directory"
    return None


def _export(flag: str, out: str, write) -> int | None:
    """Runs write(); an I/O fault or Ctrl-C is one line (the exporters write into a staging
    directory that is removed on failure, so nothing half-written is left at `out`)."""
    try:
        with stop_request.stop_at_once():
            write()
    except OSError as err:
        from jrl.io_errors import describe_os_error
        print(f"{describe_os_error(err)}: {flag} {out!r} failed; nothing was written there. The "
              f"trained policy is in the run's final checkpoint: export it with --resume {flag} "
              "DIR", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        print(f"stopped during {flag} {out!r}; nothing was written there. The trained policy "
              f"is in the run's final checkpoint: export it with --resume {flag} DIR",
              file=sys.stderr)
        return _interrupted_status(err)
    return None


def _stopped_in_setup(err: KeyboardInterrupt) -> int:
    print("stopped during setup; nothing was trained or saved", file=sys.stderr)
    return _interrupted_status(err)


def _interrupted_status(err: KeyboardInterrupt) -> int:
    """128 + the signal that stopped the run: 130 for SIGINT (or a plain KeyboardInterrupt),
    143 for SIGTERM."""
    return 128 + getattr(err, "signum", 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jrl train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None,
                        help="a shipped config's name (jrl.configs), a config .py file, or a "
                             "run's config.json (required unless --help-config)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (the --set overrides applied, the "
                             "numerical contract resolved for this platform) as JSON and exit")
    parser.add_argument("--help-config", default=None, metavar="SECTION",
                        help="print what a config section's fields mean and their values "
                             "(of --config, or the defaults) and exit; e.g. --help-config "
                             "rollout")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set train.steps=10 (repeatable)")
    parser.add_argument("--workdir", default=None, help="run directory (default runs/NAME)")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    parser.add_argument("--resume-step", type=_positive_int, default=None, metavar="N",
                        help="continue from checkpoint step N (implies --resume)")
    parser.add_argument("--overwrite", nargs="?", const="move", choices=("move", "delete"),
                        help="start over in a workdir that holds a run: move the old run aside "
                             "to WORKDIR.replaced-<time> (default) or delete it")
    parser.add_argument("--steps", type=_positive_int, default=None,
                        help="run at most this many steps now (>= 1)")
    parser.add_argument("--plot", action="store_true", help="write PNG charts at the end")
    parser.add_argument("--profile-steps", type=_step_range, default=None, metavar="A:B",
                        help="write a jax.profiler trace of RL steps A to B (1-based) to "
                             "WORKDIR/profile (TensorBoard's profile plugin or Perfetto read "
                             "it)")
    parser.add_argument("--split-processes", action="store_true",
                        help="two processes: process 0 trains, process 1 samples "
                             "(jrl.pipeline.loop.multihost); start both with `jrl local-cluster` "
                             "or a cluster launcher")
    parser.add_argument("--export-hf", default=None, metavar="DIR",
                        help="at the end, write the trained policy as a Hugging Face directory "
                             "(safetensors + tokenizer files) that transformers loads; DIR must "
                             "not exist yet (needs a tokenizer with HF files: model tokenizers)")
    parser.add_argument("--export-peft", default=None, metavar="DIR",
                        help="at the end, write the LoRA adapters (model.lora.rank > 0) as a PEFT "
                             "adapter directory (adapter_config.json + adapter_model.safetensors) "
                             "for transformers + peft; DIR must not exist yet")
    parser.add_argument("--verbosity", default="info", choices=logs.VERBOSITY,
                        help="the run's log lines shown on stdout (default info: every "
                             "progress line; warning: warnings and errors only)")
    parser.add_argument("--dump-params", default=None, help=argparse.SUPPRESS)
    from jrl.parallel.distributed import add_arguments
    add_arguments(parser)
    args = parser.parse_args(argv)
    logs.configure(args.verbosity)
    if args.config is None and args.help_config is None:
        parser.error("--config is required (a shipped config's name: see `jrl configs`)")
    try:
        config = load_config(args.config, args.set) if args.config else None
        if args.help_config is not None:
            print(section_help(args.help_config, config))
            return 0
    except (ValueError, FileNotFoundError) as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    if args.print_config:
        print(resolved_config_json(config))
        return 0
    from jrl import paths
    from jrl.pipeline.loop.workdir import check_run_paths
    try:
        # A URL (gs://...) is used as it is: its scheme and package are checked here, before
        # JAX starts (jrl.paths).
        check_run_paths(config, args.workdir or os.path.join("runs", config.name))
        for flag, path in (("--export-hf", args.export_hf), ("--export-peft", args.export_peft)):
            paths.check_url(flag, path)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    if args.plot and paths.is_url(args.workdir):
        print(f"--plot: draws its charts into a local workdir, and --workdir {args.workdir!r} "
              "is a URL; run `jrl plot` on a local copy of its metrics.jsonl instead",
              file=sys.stderr)
        return 2
    import jax

    from jrl.parallel.distributed import CoordinatorUnreachable, initialize_from_args
    from jrl.io_errors import WriteFailed
    from jrl.pipeline.loop.runner import NonFiniteError, Run  # heavy imports after the config is valid

    ours = stop_request.is_installed()     # the CLI's handler (not main() called in-process)
    try:
        with stop_request.stop_at_once():
            initialize_from_args(args)   # a no-op for a single process
        # JAX's coordination client takes SIGTERM for its preemption notifier, in C, where
        # Python's signal.getsignal does not see it; a run stops through its own request (at a
        # step all processes agree on), so install the handler again.
        if ours:
            stop_request.install()
    except (CoordinatorUnreachable, ValueError) as err:
        print(f"multi-process setup error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        return _stopped_in_setup(err)
    workdir = args.workdir or os.path.join("runs", config.name)
    problem = args.export_hf and _export_target_problem(args.export_hf)
    if problem:
        print(f"--export-hf {args.export_hf!r}: {problem}", file=sys.stderr)
        return 2
    if args.export_peft and (not config.model.lora.enabled or
                             _export_target_problem(args.export_peft)):
        why = ("writes LoRA adapters: set model.lora.rank > 0" if not config.model.lora.enabled
               else _export_target_problem(args.export_peft))
        print(f"--export-peft {args.export_peft!r}: {why}", file=sys.stderr)
        return 2
    if args.export_hf and config.model.tokenizer == "char":
        # Refused before the workdir is claimed, so that the corrected command may use it.
        print(f"--export-hf {args.export_hf!r}: model.tokenizer='char' has no Hugging Face "
              "tokenizer files; export needs a model tokenizer (model.tokenizer='model')",
              file=sys.stderr)
        return 2
    # One Run loop for every mode. Several processes without --split-processes: SPMD, every
    # host samples its share of the prompts and all train on one mesh over every process's
    # devices (see jrl.pipeline.loop.runner). With it: the train process's Run gets its batches over
    # the host link, and the rollout process serves them (jrl.pipeline.loop.multihost).
    try:
        with stop_request.stop_at_once():    # setup writes nothing a stop would lose
            if args.split_processes:
                from jrl.pipeline.loop.multihost import RolloutServer
                from jrl.pipeline.loop.split_run import split_processes
                run = split_processes(config, workdir,
                                      resume=args.resume or args.resume_step is not None,
                                      resume_step=args.resume_step, overwrite=args.overwrite,
                                      profile_steps=args.profile_steps)
            else:
                run = Run(config, workdir, resume=args.resume, resume_step=args.resume_step,
                          overwrite=args.overwrite, profile_steps=args.profile_steps)
    except (ValueError, FileNotFoundError, ImportError) as err:
        print(f"{'split-process' if args.split_processes else 'setup'} error: {err}",
              file=sys.stderr)
        return 2
    except OSError as err:   # e.g. a read-only or full disk while the run is set up
        from jrl.io_errors import describe_os_error
        print(f"setup error: {describe_os_error(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        return _stopped_in_setup(err)
    if args.split_processes and isinstance(run, RolloutServer):
        # The rollout process: it serves batches until the train process's run ends; the
        # train process saves and exports.
        try:
            run.serve()
        except KeyboardInterrupt as err:
            print("stopped; the train process saves the last finished step", file=sys.stderr)
            return _interrupted_status(err)
        return 0
    if args.export_hf and not hasattr(run.task.tokenizer, "hf_files"):
        print(f"--export-hf: the {type(run.task.tokenizer).__name__} of model.tokenizer="
              f"{config.model.tokenizer!r} has no Hugging Face tokenizer files; export needs a "
              "model tokenizer (model.tokenizer='model')", file=sys.stderr)
        return 2
    stop_request.watch_checkpoints(run.trainer.checkpointer.directory,
                                   paths.intact_checkpoint_steps)
    try:
        result = run.run(steps=args.steps)
    except NonFiniteError as err:
        print(f"stopped: {err}", file=sys.stderr)
        return 1
    except OSError as err:   # a full disk or a vanished directory: the cause, in one line
        from jrl.io_errors import describe_os_error
        saved = run.trainer.checkpointer.latest_step()
        print(f"stopped: {err if isinstance(err, WriteFailed) else describe_os_error(err)}; "
              + (f"resume from step {saved} with --resume once fixed" if saved is not None
                 else "no checkpoint was written"), file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        saved = run.trainer.checkpointer.latest_step()
        print("stopped; " + (f"resume from step {saved} with --resume" if saved is not None
                             else "no checkpoint was written yet; --resume starts the run over"),
              file=sys.stderr)
        return _interrupted_status(err)
    finally:
        run.close()
    if args.dump_params:   # tests: the final params as one .npz (written by process 0)
        from jrl.parallel import global_to_host
        params = flatten_params(global_to_host(result.state.params))
        if jax.process_index() == 0:
            import numpy as np
            np.savez(args.dump_params, **params)
    if args.export_hf and jax.process_index() == 0:
        from jrl.parallel import global_to_host
        from jrl.cli.convert import export_hf, source_mtp_head
        from jrl.pipeline.loop.summary import model_card
        card = model_card(run.summary, model_type=run.trainer.model_config.model_type,
                          base_model=config.model.path if config.model.source == "hf" else None)
        code = _export("--export-hf", args.export_hf, lambda: export_hf(
            args.export_hf, run.trainer.model_config, global_to_host(result.state.params),
            run.task.tokenizer, dtype=config.numerics.param_dtype,
            mtp_head=source_mtp_head(config.model), model_card=card))
        if code is not None:
            return code
        print(f"exported the trained policy to {args.export_hf} (Hugging Face format"
              + (", LoRA merged)" if run.trainer.model_config.lora is not None else ")"))
    if args.export_peft and jax.process_index() == 0:
        from jrl.cli.convert import export_peft, peft_base_model
        code = _export("--export-peft", args.export_peft, lambda: export_peft(
            args.export_peft, run.trainer.model_config, jax.device_get(result.state.params),
            base_model_name_or_path=peft_base_model(config.model)))
        if code is not None:
            return code
        print(f"exported the LoRA adapters to {args.export_peft} (PEFT format)")
        from jrl.models.peft_export import quantized_base_note
        note = quantized_base_note(run.trainer.model_config)
        if note is not None:
            print(note + f" ({os.path.join(args.export_peft, 'README.md')} says the same)")
    if args.plot and jax.process_index() == 0:
        from jrl.cli import plot
        plot.main([run.workdir])
    if result.final_eval:
        print("final eval: " + ", ".join(f"{k}={v:.3f}" for k, v in result.final_eval.items()))
    return 0


def _main_stoppable(argv: list[str] | None = None) -> int:
    """main() with the stop-request handler (jrl.stop_request): setup and export stop at once
    on SIGINT / SIGTERM, training at its next check point after saving what it promised. A
    signal that arrives after the run's work is done still ends the process with 128 + its
    number (nothing is left to save)."""
    stop_request.install()
    try:
        with stop_request.stop_at_once():
            import jax  # noqa: F401  (the heavy imports, interruptible)
    except KeyboardInterrupt as err:
        return _stopped_in_setup(err)
    code = main(argv)
    late = stop_request.exit_status()
    if code == 0 and late is not None:
        print(f"stopped by signal {late - 128} after the run's work was done; everything is "
              "saved", file=sys.stderr)
        return late
    return code


def cli(argv: list[str] | None = None) -> None:
    """`jrl train`: runs main with the stop handler, then ends the process with its status."""
    code = _main_stoppable(argv)
    from jrl.parallel.distributed import finish
    finish(code)   # several processes: the others stop watching this one, or exit on a failure
    if code in (130, 143):
        # Interrupted: a rollout thread may still be inside an XLA call that tearing the
        # interpreter down would crash; everything is saved and flushed, so leave directly.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    cli()
