"""The ``agentflash`` command line: thin wrappers that parse flags into the library's objects."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Annotated

import typer

from agentflash.errors import UserError, UserErrors, expand_user

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Agents and tool calls on an engine that makes structured output fast.")
train_app = typer.Typer(no_args_is_help=True, help="Train the demo tokenizer, target and drafter.")
app.add_typer(train_app, name="train")


def fail(message: str | UserError) -> None:
    """Exit 2 with the error on one line; several problems (a workflow file's) a line each."""
    problems = message.problems if isinstance(message, UserErrors) else [str(message)]
    for problem in problems:
        typer.echo(f"error: {one_line(problem)}", err=True)
    raise typer.Exit(2)


def one_line(message: str) -> str:
    """An error on one line, whatever a library below wrote into it."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


def _path_option(help: str) -> typer.models.OptionInfo:
    """A path flag with ``~`` expanded, as ``--model``'s is (a shell leaves ``--flag=~/x``
    as it is)."""
    return typer.Option(parser=expand_user, help=help)


def _input_path(value: str):
    """A file flag's value: ``-`` is standard input (``inputs.STDIN``), a path has ``~``
    expanded (``./-`` names a file called ``-``)."""
    from agentflash import inputs

    return inputs.STDIN if value == "-" else expand_user(value)


def _input_option(help: str) -> typer.models.OptionInfo:
    return typer.Option(parser=_input_path, help=f"{help}; - reads standard input")


ModelOpt = Annotated[str, typer.Option("--model", help="'demo' or a Hugging Face model directory")]
HELD_OUT_PER_KIND = 16  # train drafter: conversations of each kind kept for validation


@app.command()
def generate(
    prompt: Annotated[str | None, typer.Option(help="user message")] = None,
    messages: Annotated[Path | None, _input_option("chat messages (JSON list)")] = None,
    tools: Annotated[Path | None, _input_option("OpenAI tools list (JSON)")] = None,
    requests: Annotated[Path | None, _input_option("one request per JSON line")] = None,
    model: ModelOpt = "demo",
    max_tokens: Annotated[int | None, typer.Option(
        "--max-tokens", help="new tokens per request at most (default 256; a --requests line's "
                             "max_tokens wins)")] = None,
    temperature: Annotated[float | None, typer.Option()] = None,
    top_p: Annotated[float | None, typer.Option("--top-p")] = None,
    seed: Annotated[int | None, typer.Option()] = None,
    stop: Annotated[list[str] | None, typer.Option(help="stop string (repeatable)")] = None,
    schema: Annotated[Path | None, _input_option(
        "JSON Schema file the reply must match")] = None,
    regex: Annotated[str | None, typer.Option(
        help="regular expression the reply must match")] = None,
    tool_choice: Annotated[str | None, typer.Option(
        "--tool-choice", help="auto | required | none | a tool name (with --tools)")] = None,
    mode: Annotated[str, typer.Option(
        help="plain | dflash | auto (the router: dflash where it pays)")] = "auto",
    drafter: Annotated[str, typer.Option(
        help="auto | demo | none | a DFlash drafter directory")] = "auto",
    as_json: Annotated[bool, typer.Option(
        "--json", help="print one JSON object per request")] = False,
) -> None:
    """Generate a reply with the embedded engine."""
    from agentflash import inputs

    try:
        speculation = {"plain": "off", "dflash": "dflash", "auto": "auto"}.get(mode)
        if speculation is None:
            raise UserError(f"--mode must be plain, dflash or auto, got {mode!r}")
        from_stdin = [flag for flag, value in (("--messages", messages), ("--tools", tools),
                                               ("--schema", schema), ("--requests", requests))
                      if isinstance(value, inputs.Stdin)]
        if len(from_stdin) > 1:  # standard input is read once, by one of them
            raise UserError(f"only one file flag can read standard input ('-'), not "
                            f"{' and '.join(from_stdin)}")
        if isinstance(schema, inputs.Stdin):
            schema = inputs.load_stdin_schema()
        defaults = {"max_tokens": max_tokens if max_tokens is not None else 256,
                    "temperature": temperature, "top_p": top_p, "seed": seed, "stop": stop,
                    "speculation": speculation, "schema": schema, "regex": regex,
                    "tool_choice": _tool_choice(tool_choice)}
        if tools is not None:
            defaults["tools"] = inputs.load_tools(tools)
        flag_grammar = None
        if requests is not None:
            if prompt is not None or messages is not None:
                raise UserError("--requests cannot be combined with --prompt or --messages")
            inputs.make_params(defaults, "command line")  # a bad flag is not a line's fault
            todo = inputs.load_requests(requests, defaults)
            with contextlib.suppress(UserError):  # (flags that lines complete: a line's tools)
                # the flags' grammar, which a line that keeps it does not answer for
                flag_grammar = inputs.flags_input(defaults).params.grammar
        else:
            if (prompt is None) == (messages is None):
                raise UserError("give exactly one of --prompt, --messages or --requests")
            if messages is not None:
                defaults["messages"] = inputs.load_messages(messages)
            else:
                defaults["prompt"] = prompt
            todo = [inputs.make_input(defaults, "command line")]
        engine = _load_engine(model, drafter)
        if speculation == "dflash" and engine.drafter is None:
            raise UserError("--mode dflash needs a drafter (--drafter demo or a directory)")
        # a prompt the engine cannot hold is the messages file's fault, a bad flag is not
        prompts = _check_all(engine, todo, str(messages) if messages is not None else None,
                             flag_grammar)
        failed = 0
        for item, ids in zip(todo, prompts):
            result = engine.generate(ids, item.params)
            if as_json:
                typer.echo(json.dumps(result.to_dict()))
            else:
                typer.echo(result.text)
            if result.finish_reason == "error":  # the other requests are still answered
                failed += 1
                typer.echo(f"error: {item.where}: the engine failed this request: "
                           f"{one_line(result.error or '')}", err=True)
    except UserError as err:
        fail(_flag_named(str(err)))
    if failed:
        raise typer.Exit(1)


# the request fields generate's flags set, each flag the field's name in dashes
FLAG_FIELDS = ("prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "schema", "regex",
               "tool_choice")


def _flag_named(message: str) -> str:
    """The command line's error on the field it names first said of the flag the user typed
    ("command line: max_tokens must be..." is "--max-tokens must be..."); a requests line's
    error names its field, as the line does."""
    if message.startswith("command line: give one of "):  # the grammar's flags, every one
        from agentflash.inputs import GRAMMAR_FIELDS

        return re.sub(rf"\b({'|'.join(GRAMMAR_FIELDS)})\b",
                      lambda m: "--" + m.group(1).replace("_", "-"), message)
    return re.sub(rf"^command line: ({'|'.join(FLAG_FIELDS)})\b",
                  lambda m: "--" + m.group(1).replace("_", "-"), message)


def _check_all(engine, todo, prompt_source: str | None = None, flag_grammar=None
               ) -> list[list[int]]:
    """Every request's prompt (token ids) within the engine's limits, its grammar compiled (and
    cached) and its speculation possible, before the first one runs, so that a bad last line
    fails before the lines above it are answered; a grammar that is ``flag_grammar`` (the
    command line's, which a requests line kept) is the command line's fault. Returns the
    prompts."""
    from agentflash.engine.request import Speculation
    from agentflash.grammar import GrammarError

    prompts = []
    for item in todo:
        if item.params.speculation is Speculation.DFLASH and engine.drafter is None:
            raise UserError(f"{item.where}: speculation dflash needs a drafter (--drafter demo "
                            f"or a directory)")
        prompts.append(engine.chat_prompt(item.messages, item.tools))
        try:
            engine.check_prompt(prompts[-1])
        except UserError as err:
            raise UserError(f"{prompt_source or item.where}: {err}") from None
        if item.params.grammar is not None:
            try:
                engine.compile(item.params.grammar)
            except GrammarError as err:  # its origin names the request, or only its file
                message = str(err).removeprefix(f"{item.where}: ")
                where = "command line" if item.params.grammar == flag_grammar else item.where
                raise UserError(f"{where}: {message}") from None
    return prompts


def _suites(text: str, known: tuple[str, ...]) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise UserError(f"--suites names none (known: {', '.join(known)})")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UserError(f"--suites: unknown suite {unknown[0]!r} (known: {', '.join(known)})")
    twice = [n for i, n in enumerate(names) if n in names[:i]]
    if twice:  # its rows twice over, in one table
        raise UserError(f"--suites names {twice[0]!r} twice")
    return names


def _positive(**values: int | None) -> None:
    """Each given count at least 1 (None: left to its default), checked before any work."""
    for name, value in values.items():
        if value is not None and value < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def _out_dir(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise UserError(f"{path}: --out must be a directory, and this is a file")
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise UserError(f"{path}: --out cannot be made: {parent} is a file")


def _tool_choice(value: str | None) -> str | dict | None:
    if value is None or value in ("auto", "required", "none"):
        return value
    return {"type": "function", "function": {"name": value}}


def _load_engine(model: str, drafter: str = "auto"):
    from agentflash.engine.engine import Engine

    return Engine.from_pretrained(model, drafter=None if drafter == "none" else drafter)


@app.command()
def bench(
    model: ModelOpt = "demo",
    suites: Annotated[str, typer.Option(
        help="comma-separated: tool_call,code,math,prose,json,mixed,agent"),
    ] = "tool_call,code,math,prose",
    num_prompts: Annotated[int | None, typer.Option(
        "--num-prompts", help="prompts per suite (4; with --concurrency: its highest level)"),
    ] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens")] = 128,
    drafter: Annotated[str, typer.Option(help="auto | demo | none | a drafter directory")] = "auto",
    concurrency: Annotated[str | None, typer.Option(
        help="e.g. 1,4,8,32: plain, dflash and router rows with that many requests at once, "
             "decoding without the suites' grammars ('agent' under its tools')")] = None,
    rounds: Annotated[int | None, typer.Option(
        help="with --concurrency: turns each mode takes; the median is shown (3)")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Side-by-side speed of the engine and its peers on held-out prompts."""
    from agentflash import bench as bench_mod

    try:
        names = _suites(suites, bench_mod.ALL_SUITES)
        _positive(num_prompts=num_prompts, max_tokens=max_tokens, rounds=rounds)
        draft = None if drafter == "none" else drafter
        if concurrency is not None:  # given empty: refused, not the one-stream bench
            levels = _int_list(concurrency, "--concurrency", distinct=True)
            report = bench_mod.run_concurrency(
                model, names, levels, max_tokens, draft, num_prompts, rounds=rounds or 3
            )
        elif rounds is not None:  # the one-stream bench runs each row once: it was dropped
            raise UserError("--rounds is for --concurrency runs (the one-stream rows run once)")
        else:
            report = bench_mod.run(model, names, num_prompts or 4, max_tokens, draft)
    except UserError as err:
        fail(str(err))
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    elif concurrency is not None:
        bench_mod.print_concurrency_table(report)
    else:
        bench_mod.print_table(report)


def split_shares(n: int, shares: list[int]) -> list[int]:
    """n split in proportion to shares, summing to n: the floors, then one more to the largest
    remainders (the earlier share on a tie)."""
    total = sum(shares)
    counts = [n * k // total for k in shares]
    by_remainder = sorted(range(len(shares)), key=lambda i: -(n * shares[i] % total))
    for i in by_remainder[:n - sum(counts)]:
        counts[i] += 1
    return counts


def _int_list(text: str, flag: str, minimum: int = 1, distinct: bool = False) -> list[int]:
    try:  # an empty item ("1,,4", "1,4,") is a typo, not nothing
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise UserError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if min(values) < minimum:
        kind = "positive integers" if minimum == 1 else f"integers from {minimum}"
        raise UserError(f"{flag} takes {kind}, got {text!r}")
    twice = [v for i, v in enumerate(values) if v in values[:i]]
    if distinct and twice:
        raise UserError(f"{flag} names {twice[0]} twice")
    return values


@app.command("eval-tool-calls")
def eval_tool_calls(
    model: ModelOpt = "demo",
    num: Annotated[int, typer.Option(help="held-out conversations")] = 100,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """How often the model, unconstrained, writes a valid call naming a tool it was given."""
    from agentflash import bench as bench_mod

    try:
        _positive(num=num)
        report = bench_mod.eval_tool_calls(model, num)
    except UserError as err:
        fail(str(err))
    if as_json:
        typer.echo(json.dumps(report))
        return
    counts = report["counts"]
    typer.echo(f"{report['model']}: {counts['prompts']} held-out tool-call prompts, no grammar")
    for key, rate in report["rates"].items():
        typer.echo(f"  {key.replace('_', ' '):<16} {counts[key]:>5}  {rate:7.1%}")


@app.command()
def validate(
    file: Annotated[Path, typer.Argument(parser=expand_user, help="workflow YAML file")],
) -> None:
    """Check a workflow file: its schema, names, needs, templates and python tools."""
    from agentflash.runtime.workflow import load_workflow

    try:
        wf = load_workflow(file)
    except UserError as err:
        fail(err)
    typer.echo(f"{file}: ok (workflow {wf.name!r}: {len(wf.agents)} agents, {len(wf.tools)} "
               f"tools, {len(wf.steps)} steps)")


@contextlib.contextmanager
def _stdout_to_stderr():
    """What is written to stdout in the block goes to stderr: Python's prints, and where stdout
    is the process's file descriptor 1, what a subprocess or C code writes to it too."""
    sys.stdout.flush()
    try:
        saved = os.dup(1) if sys.stdout.fileno() == 1 else None
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):  # a test's capture
        saved = None
    if saved is not None:
        os.dup2(sys.stderr.fileno(), 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


@app.command("run")
def run_workflow(
    file: Annotated[Path, typer.Argument(parser=expand_user, help="workflow YAML file")],
    inputs: Annotated[list[str] | None, typer.Option("--input", "-i",
                                                        help="KEY=VALUE (repeatable)")] = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="print outputs, steps and stats as JSON")] = False,
    model: Annotated[str | None, typer.Option(
        "--model", help="run on the embedded engine with this model ('demo' or a directory) "
                        "instead of the file's model section")] = None,
) -> None:
    """Run a workflow, with a live view of its steps (on stderr) unless --json."""

    from rich.console import Console

    from agentflash import aio
    from agentflash.runtime.errors import RunError
    from agentflash.runtime.live_view import run_with_view
    from agentflash.runtime.workflow import load_workflow, parse_input_pairs

    # with --json, stdout is the JSON alone: what python tools print goes to stderr
    quiet = _stdout_to_stderr() if as_json else contextlib.nullcontext()
    try:
        with quiet:
            wf = load_workflow(file, model)
            values = wf.resolve_inputs(parse_input_pairs(inputs or []))
            if as_json:
                result = aio.run(wf.run, values)
            else:
                result = aio.run(run_with_view, wf, values, Console(stderr=True))
    except UserError as err:
        fail(err)
    except RunError as err:  # on one line, like every error: a tool's message may hold more
        typer.echo(f"error: {one_line(str(err))}", err=True)
        if as_json and err.steps is not None:  # the steps that finished, as a run prints them
            typer.echo(json.dumps({"error": one_line(str(err)),
                                   "steps": {sid: r.to_dict() for sid, r in err.steps.items()}},
                                  indent=2, default=str))
        raise typer.Exit(1) from None
    except KeyboardInterrupt:  # Ctrl-C: the view shows what ran; the shell's code for it
        typer.echo("error: interrupted", err=True)
        raise typer.Exit(130) from None
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2, default=str))
    else:
        for name, value in result.outputs.items():
            shown = value if isinstance(value, str) else json.dumps(value)
            typer.echo(f"{name}: {shown}")


@app.command()
def serve(
    model: ModelOpt = "demo",
    drafter: Annotated[str, typer.Option(help="auto | demo | none | a drafter directory")] = "auto",
    host: Annotated[str, typer.Option(help="address to bind (loopback by default)")] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8000,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="AGENTFLASH_API_KEY",
        help="require 'Authorization: Bearer KEY' on /v1 (or set AGENTFLASH_API_KEY)")] = None,
    served_name: Annotated[str | None, typer.Option(
        "--served-model-name", help="the model name clients ask for (default: demo or the "
                                    "directory's name)")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="per request, at most")] = 1024,
    max_concurrent: Annotated[int, typer.Option(
        "--max-concurrent", help="requests in flight; more get a 429")] = 64,
    max_body_bytes: Annotated[int, typer.Option("--max-body-bytes")] = 1 << 20,
    prefix_cache_mb: Annotated[float, typer.Option(
        "--prefix-cache-mb", help="prompts kept for the next prompt that begins the same way "
                                  "(0: none)")] = 64.0,
    max_running: Annotated[int, typer.Option(
        "--max-running", help="requests the engine decodes together; the rest wait")] = 8,
    max_len: Annotated[int, typer.Option(
        "--max-len", help="tokens per request, prompt and reply")] = 2048,
    kv_budget_mb: Annotated[float | None, typer.Option(
        "--kv-budget-mb", help="caps --max-running to the requests of --max-len tokens whose "
                               "keys, values and drafter contexts fit")] = None,
) -> None:
    """Serve the engine behind the OpenAI chat-completions API (/v1/chat/completions)."""

    try:
        if api_key is None and os.environ.get("AGENTFLASH_API_KEY") is not None:
            # set and empty (click reads it as unset): a key meant and none given
            raise UserError("AGENTFLASH_API_KEY is set and empty: give it a key, or unset it "
                            "to serve without one")
        from agentflash.server.app import ServerConfig
        from agentflash.server.app import serve as run_server

        try:
            config = ServerConfig(model=model, drafter=drafter, host=host, port=port,
                                  api_key=api_key, served_name=served_name,
                                  max_tokens=max_tokens, max_concurrent=max_concurrent,
                                  max_body_bytes=max_body_bytes, prefix_cache_mb=prefix_cache_mb,
                                  max_running=max_running, max_len=max_len,
                                  kv_budget_mb=kv_budget_mb)
        except UserError as err:  # "server max_len ...": the flag it came from
            flags = {"served_name": "served_model_name"}
            raise UserError(re.sub(r"^server (\w+)", lambda m: "--" + flags.get(
                m.group(1), m.group(1)).replace("_", "-"), str(err))) from None
        where = f"http://{host}:{port}/v1" if port else f"a free port of {host}"
        typer.echo(f"agentflash serve: loading {config.name}, to serve on {where}"
                   f"{' (API key required)' if api_key else ''}", err=True)
        try:
            run_server(config)
        except UserError as err:  # the engine's budget check, made as the model loads
            raise UserError(re.sub(r"^kv_budget_mb ", "--kv-budget-mb ", str(err))) from None
    except KeyboardInterrupt:  # Ctrl-C while the model loads (once it serves, uvicorn stops)
        typer.echo("error: interrupted", err=True)
        raise typer.Exit(130) from None
    except ImportError as err:
        fail(f"the server needs its extra: pip install 'agentflash[server]' "
             f"({err.name} is missing)")
    except UserError as err:
        fail(str(err))


@app.command("bench-server")
def bench_server(
    model: ModelOpt = "demo",
    suites: Annotated[str, typer.Option(
        help="comma-separated: tool_call,code,math,prose")] = "tool_call,prose",
    num_prompts: Annotated[int, typer.Option("--num-prompts", help="prompts per suite")] = 8,
    max_tokens: Annotated[int, typer.Option("--max-tokens")] = 64,
    concurrency: Annotated[str, typer.Option(help="requests in flight, e.g. 1,4")] = "1,4",
    drafter: Annotated[str, typer.Option(
        help="none (default: plain decoding on both sides) | auto | demo | a drafter directory")
    ] = "none",
    rounds: Annotated[int, typer.Option(help="turns each path takes; the median is shown")] = 3,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """The overhead of the HTTP server path over the in-process engine, on one workload."""
    try:
        from agentflash.server import bench as server_bench

        names = tuple(_suites(suites, ("tool_call", "code", "math", "prose")))
        _positive(num_prompts=num_prompts, max_tokens=max_tokens, rounds=rounds)
        levels = tuple(_int_list(concurrency, "--concurrency", distinct=True))
        report = server_bench.run(model, names, num_prompts, max_tokens, levels, drafter, rounds)
    except UserError as err:
        fail(str(err))
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        server_bench.print_table(report)


@train_app.command("target")
def train_target(
    out: Annotated[Path, _path_option(
        "output directory (resumes if it holds checkpoints)")],
    steps: Annotated[int, typer.Option()] = 1800,
    save_every: Annotated[int, typer.Option(
        "--save-every", help="steps between checkpoints (an interrupted run resumes there)")] = 100,
) -> None:
    """Train the demo tokenizer and target on the synthetic agent corpus."""
    from agentflash.train.runs import check_out_dir
    from agentflash.train.target import TargetTrainConfig, target_settings
    from agentflash.train.target import train_target as run

    try:
        _out_dir(out)
        _positive(steps=steps, save_every=save_every)
        cfg = TargetTrainConfig(steps=steps, save_every=save_every)
        check_out_dir(out, "target", steps, settings=target_settings(cfg))
        run(out, cfg)
    except UserError as err:
        fail(str(err))


@train_app.command("drafter")
def train_drafter(
    target: Annotated[Path, _path_option(
        "the target's Hugging Face directory")],
    out: Annotated[Path, _path_option(
        "output directory (resumes if it holds checkpoints)")],
    save_every: Annotated[int, typer.Option(
        "--save-every", help="steps between checkpoints (an interrupted run resumes there)")] = 100,
    steps: Annotated[int, typer.Option()] = 1000,
    num_layers: Annotated[int, typer.Option("--num-layers")] = 2,
    block_size: Annotated[int, typer.Option("--block-size")] = 16,
    num_anchors: Annotated[int, typer.Option("--num-anchors", help="blocks per sequence")] = 64,
    num_conversations: Annotated[int, typer.Option(
        "--num-conversations",
        help="corpus prompts the target answers (the last 16 of each kind are held out for "
             "validation; the rest train, but those with a held-out one's prompt or first "
             "answer)")] = 2500,
    mix: Annotated[str, typer.Option(
        help="shares of tool_call,code,math,prose among those prompts")] = "60,12,16,12",
    init: Annotated[str | None, typer.Option(
        help="start from this drafter's weights (a directory, or demo)")] = None,
    lr: Annotated[float, typer.Option()] = 6e-4,
    constrained_tool_calls: Annotated[float, typer.Option(
        "--constrained-tool-calls",
        help="share of tool-call prompts answered under the tools' grammar, as served")] = 0.0,
    corpus_seed: Annotated[int, typer.Option(
        "--corpus-seed", help="seed of the corpus prompts (another seed: other prompts)")] = 1,
    target_layer_ids: Annotated[str | None, typer.Option(
        "--target-layer-ids",
        help="target layers the drafter reads, e.g. 1,3,5 (default: evenly spaced from 1 to "
             "L-3); with --init, a drafter reading some of them is widened")] = None,
) -> None:
    """Train a DFlash drafter on the target's own answers (SpecForge recipe)."""
    from agentflash.train.corpus import CorpusConfig
    from agentflash.train.drafter import DrafterTrainConfig, drafter_settings
    from agentflash.train.drafter import train_drafter as run
    from agentflash.train.runs import check_out_dir

    try:
        _out_dir(out)
        _positive(num_conversations=num_conversations, save_every=save_every, steps=steps,
                  num_anchors=num_anchors, num_layers=num_layers)
        if block_size < 2:
            raise UserError(f"--block-size must be at least 2, got {block_size}")
        if not 0.0 < lr < float("inf"):  # NaN too
            raise UserError(f"--lr must be a positive number, got {lr}")
        if not 0.0 <= constrained_tool_calls <= 1.0:
            raise UserError(f"--constrained-tool-calls must be in [0, 1], got "
                            f"{constrained_tool_calls}")
        shares = _int_list(mix, "--mix")
        if len(shares) != 4:
            raise UserError(f"--mix needs four shares (tool_call,code,math,prose), got {mix!r}")
        layer_ids = (
            tuple(_int_list(target_layer_ids, "--target-layer-ids", minimum=0))
            if target_layer_ids is not None  # given empty: refused, not the default layers
            else ()
        )
        if list(layer_ids) != sorted(set(layer_ids)):  # before the target loads
            raise UserError(f"--target-layer-ids must be increasing, got {target_layer_ids!r}")
        n = num_conversations
        tool, code, math, prose = counts = split_shares(n, shares)
        if max(counts) <= HELD_OUT_PER_KIND:
            raise UserError(f"--num-conversations {n} (--mix {mix}: {tool}, {code}, {math}, "
                            f"{prose}) leaves nothing to train on: the last "
                            f"{HELD_OUT_PER_KIND} of each kind are held out for validation")
        corpus = CorpusConfig(seed=corpus_seed, num_tool_call=tool, num_code=code, num_math=math,
                              num_prose=prose)
        cfg = DrafterTrainConfig(num_layers=num_layers, block_size=block_size, steps=steps,
                                 num_anchors=num_anchors, max_response_tokens=256,
                                 num_val_per_kind=HELD_OUT_PER_KIND, corpus=corpus, lr=lr,
                                 init=init,
                                 constrained_tool_calls=constrained_tool_calls,
                                 target_layer_ids=layer_ids, save_every=save_every)
        check_out_dir(out, "drafter", steps, str(target), drafter_settings(cfg))
        run(target, out, cfg)
    except (UserError, ValueError) as err:
        fail(str(err))


def main() -> None:
    try:
        try:
            app()
        except UserError as err:  # raised outside a command's own handling
            typer.echo(f"error: {one_line(str(err))}", err=True)
            sys.exit(2)
        except OSError as err:
            _exit_if_a_write_failed(err)
            raise
    except SystemExit as done:
        _exit_now_if_loading(done.code)
        raise
    except BaseException as err:  # past a command's own handling (a cancelled wait, re-raised
        # as Ctrl-C): a load still going would hold the exit for ever
        if _loading():
            if isinstance(err, KeyboardInterrupt):
                _exit_now_if_loading("error: interrupted", 130)
            traceback.print_exc()
            _exit_now_if_loading(None, 1)
        raise


# what a write that failed raises (a full disk or quota, a file-size limit, a device's error)
_WRITE_FAILED = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO}


def _exit_if_a_write_failed(err: OSError) -> None:
    """Exit with an error line if ``err`` says a write failed (standard output to a full disk
    or /dev/full: a closed pipe is typer's). What standard output still holds goes to
    /dev/null if it cannot be written, so that the exit's own flush does not fail again."""
    if err.errno not in _WRITE_FAILED:
        return
    try:
        sys.stdout.flush()
    except OSError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    where = f"{err.filename}: " if err.filename else ""
    typer.echo(f"error: {where}cannot write: {err.strerror}", err=True)
    sys.exit(1)


def _loading() -> bool:
    """Whether a model loads in the background (``async_engine.loading``)."""
    engine = sys.modules.get("agentflash.engine.async_engine")  # not imported: none loads
    return engine is not None and engine.loading()  # (importing it costs torch's import, 1 s)


def _exit_now_if_loading(code: int | str | None, status: int | None = None) -> None:
    """Exit at once, with ``code`` (a message is said, then ``status``, 1 by default), if a
    model is still loading in the background (Ctrl-C while it loaded): the usual exit waited
    for the load, then torch's threads aborted it."""
    if not _loading():
        return
    if isinstance(code, str):
        print(code, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    if status is None:
        status = code if isinstance(code, int) else 0 if code is None else 1
    os._exit(status)


if __name__ == "__main__":
    main()
