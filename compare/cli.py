"""``h5cmp``: compare two dumps (or list one). Exit codes like h5diff: 0 = B agrees with A within
what the precisions explain, 1 = differences found, 2 = error."""
from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Optional

import click

from . import format as fmt

EXIT_SAME, EXIT_DIFFERENT, EXIT_ERROR = 0, 1, 2
EXIT_PIPE_CLOSED = 141  # as a shell reports a tool that SIGPIPE ended (128 + 13): `| head`
DEFAULT_TOP = 20  # failing rows the text report shows unless --top or --all


@dataclasses.dataclass
class Options:
    """What a comparison was asked for: the command line's options, in one object."""

    rtol: Optional[float] = None
    atol: Optional[float] = None
    steps: tuple = ()
    modules: tuple = ()
    kinds: tuple = ()
    outputs: tuple = ()
    plot: Optional[Path] = None
    heatmap: Optional[Path] = None
    dot: Optional[Path] = None
    injected: Optional[Path] = None
    rank: Optional[int] = None
    jobs: int = 1
    show_all: bool = False
    top: Optional[int] = None  # rows shown: DEFAULT_TOP failing rows, every row with --all
    order: str = "added"
    quiet: bool = False
    mapping: Optional[Path] = None
    suggest_map: bool = False
    ranks: bool = False
    scheduler: Optional[str] = None


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("a", type=click.Path(path_type=Path, readable=False))
@click.argument("b", type=click.Path(path_type=Path, readable=False), required=False)
@click.option("--rtol", type=click.FloatRange(min=0), help="Relative tolerance for every element "
              "(default: the error model judges each record against what the precisions "
              "explain).")
@click.option("--atol", type=click.FloatRange(min=0),
              help="Absolute tolerance for every element (with --rtol).")
@click.option("--step", "steps", multiple=True, callback=lambda ctx, param, value: [
    _step_spec(v) for v in value], help="Only step S, or E:S (repeatable).")
@click.option("--module", "modules", multiple=True,
              help="Only show modules matching this glob (repeatable; the verdict is the step's).")
@click.option("--kind", "kinds", multiple=True, type=click.Choice(fmt.KINDS),
              help="Only show records of this kind (repeatable; the verdict is the step's).")
@click.option("-o", "--output", "outputs", multiple=True, type=click.Path(path_type=Path),
              help="Write every row to FILE: .csv, .json, .html or .xlsx (needs h5cmp[xlsx]); "
                   "repeatable.")
@click.option("--plot", type=click.Path(path_type=Path),
              help="Draw each record's added error against its expected level to FILE.png "
                   "(needs h5cmp[plot]).")
@click.option("--heatmap", type=click.Path(path_type=Path),
              help="Draw a modules x steps heat map of the relative error to FILE.png "
                   "(needs h5cmp[plot]).")
@click.option("--dot", type=click.Path(path_type=Path),
              help="Write the first compared step's call graph, coloured by status, to FILE.dot "
                   "(.png/.svg rendered with Graphviz).")
@click.option("--injected", type=click.Path(path_type=Path),
              help="A re-run of B on A's values (HookerAndDumper(..., inject=A)): report each "
                   "record's local error, the origins, and exit 1 if there is one, else 0.")
@click.option("--track", metavar="MODULE:KIND:INDEX[:CALL]",
              help="With only A: plot this tensor over A's steps into the --plot file.")
@click.option("--rank", type=click.IntRange(min=0),
              help="Distributed rank to compare (default: rank by rank; a non-distributed dump "
                   "is compared with the lowest rank of the other).")
@click.option("--ranks", is_flag=True,
              help="With only A, a distributed dump: compare its ranks with the lowest one where "
                   "they must agree (parameters that are not sharded, replicated DTensors); exit "
                   "1 at the first disagreement.")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=1, show_default=True,
              help="Compare in N processes.")
@click.option("--scheduler", metavar="ADDRESS",
              help="Compare on the Dask cluster of this scheduler (e.g. tcp://host:8786; needs "
                   "h5cmp[dask]); its workers read the dumps at the same paths.")
@click.option("--map", "mapping", type=click.Path(path_type=Path),
              help="Rename B's module paths before pairing, by the rules of FILE (YAML, needs "
                   "h5cmp[map], or JSON): a list of {glob: PATTERN, to: NAME} or {regex: ..., "
                   "to: ...}.")
@click.option("--suggest-map", is_flag=True,
              help="Print rename rules that align B's module calls with A's (for --map), and "
                   "compare nothing.")
@click.option("--all", "show_all", is_flag=True, help="Show every row, in execution order.")
@click.option("--top", type=click.IntRange(min=1),
              help=f"Show at most N rows [default: {DEFAULT_TOP}; with --all, every row].")
@click.option("--order", type=click.Choice(["added", "execution"]), default="added",
              show_default=True, help="Failing rows worst added error first, or as they ran.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing; only the exit code tells.")
@click.option("--debug", is_flag=True, envvar="H5CMP_DEBUG",
              help="Show the traceback of an internal error (also H5CMP_DEBUG=1).")
def main(a: Path, b: Optional[Path], track: Optional[str], debug: bool, **options) -> None:
    """Compare dumps A and B (files or directories of step files) tensor by tensor, judge each
    record against what the precisions involved explain, and report the first divergence.
    With only A, list its steps, module calls and tensors (or, with --ranks, compare its
    ranks).

    Exit status: 0 B agrees with A, 1 differences found, 2 error (141: the reader of the
    output closed it early, as `| head` does).
    """
    from .errors import DumpError
    try:
        if options["ranks"]:
            sys.exit(ranks_command(a, b, Options(**options)))
        if track and b is not None:
            raise DumpError(f"--track {track}: plots one tensor over the steps of one dump; "
                            f"give only A")
        if b is None:
            if track:
                _track(a, track, options["plot"])
            else:
                from .inspect import format_tree
                click.echo(format_tree(a))
            sys.exit(EXIT_SAME)
        sys.exit(compare_command(a, b, Options(**options)))
    except DumpError as exc:
        click.echo(f"h5cmp: error: {exc}", err=True)
        sys.exit(EXIT_ERROR)
    except BrokenPipeError:  # `h5cmp A B | head`: nothing more is read, and nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (at exit's flush)
        sys.exit(EXIT_PIPE_CLOSED)
    except Exception as exc:  # a bug of ours: never exit 1, which means "differences found"
        if debug:
            raise
        first_line = next(iter(str(exc).splitlines()), "")
        click.echo(f"h5cmp: internal error: {type(exc).__name__}: {first_line}; this is a bug "
                   f"in h5cmp: rerun with --debug (or H5CMP_DEBUG=1) for the traceback and "
                   f"report it", err=True)
        sys.exit(EXIT_ERROR)


def compare_command(a: Path, b: Path, opts: Options) -> int:
    """Run one comparison as ``h5cmp A B`` does; returns the exit status."""
    from .comparison import ASSEMBLED, NAME_MAPPING, NOT_COMPARED, compare_dumps
    from .dump import load_dump
    from .pairing import align_ranks, select
    from .plot import check_plot_path, plot_errors, plot_heatmap
    from .report import check_output_path, export, render_text
    from .summary import summarize

    for output in opts.outputs:
        check_output_path(output)
    for picture in (opts.plot, opts.heatmap):
        if picture is not None:
            check_plot_path(picture)
    full_a, full_b = load_dump(a), load_dump(b)  # compare_dumps may put shards together
    rerun = load_dump(opts.injected) if opts.injected is not None else None
    dump_a, dump_b, note = align_ranks(full_a, full_b, opts.rank)
    if opts.suggest_map:
        from .suggest import suggest_mapping
        suggested = suggest_mapping(dump_a, dump_b)
        click.echo(suggested.to_text() if suggested.rules else
                   "# the aligned module calls already share their names: no rule needed")
        return EXIT_SAME
    mapping = None
    if opts.mapping is not None:
        from .mapping import load_mapping
        mapping = load_mapping(opts.mapping)  # before the compare: a bad file fails at once
    if note and not opts.quiet:
        click.echo(f"h5cmp: {note}", err=True)
    client = None
    if opts.scheduler is not None:
        from .cluster import connect
        client = connect(opts.scheduler)
    show_progress = not opts.quiet and sys.stderr.isatty()
    total = int((dump_a.index["dataset"] != "").sum())
    with click.progressbar(length=total, label="comparing", file=sys.stderr,
                           hidden=not show_progress) as bar:
        try:
            result = compare_dumps(full_a, full_b, opts.rtol, opts.atol, steps=opts.steps,
                                   rank=opts.rank, jobs=opts.jobs, progress=bar.update,
                                   mapping=mapping, client=client)
        finally:
            if client is not None:
                client.close()
    if not opts.quiet:
        for note in [result.attrs.get(NAME_MAPPING), result.attrs.get(ASSEMBLED),
                     *result.attrs.get(NOT_COMPARED, ())]:
            if note:
                click.echo(f"h5cmp: {note}", err=True)
    summary = summarize(result)  # of every record: the filters below only choose what is shown
    origins = None
    if rerun is not None:  # the re-run's answer is the definite one: checked before any output
        from .injection import localize
        origins = localize(dump_a, dump_b, rerun, opts.rtol, opts.atol, steps=opts.steps,
                           modules=opts.modules, free_result=result)
        summary.rerun_given = True
    shown = select(result, opts.modules, opts.kinds).reset_index(drop=True)
    if shown.empty:
        from .errors import DumpError
        chosen = " and ".join(f"{name} {', '.join(values)}" for name, values in (
            ("--module", opts.modules), ("--kind", opts.kinds)) if values)
        some = ", ".join(list(dict.fromkeys(m or "<root>" for m in result["module"]))[:5])
        raise DumpError(f"{a} / {b}: nothing to show: no record matches {chosen} (modules "
                        f"include {some}; globs match a path or path.Class)")
    for output in opts.outputs:
        export(shown, summary, output)
    if opts.plot is not None:
        plot_errors(shown, summary, opts.plot)
    if opts.heatmap is not None:
        plot_heatmap(shown, opts.heatmap)
    if opts.dot is not None:
        from .dataflow import to_dot, write_dot
        first = result.iloc[0] if len(result) else None
        write_dot(to_dot(dump_a, *(() if first is None else (first["epoch"], first["step"])),
                         result=result), opts.dot)
    if not opts.quiet:
        top = opts.top if opts.top is not None or opts.show_all else DEFAULT_TOP
        click.echo(render_text(shown, summary, opts.show_all, top, opts.order))
    if origins is not None:
        from .injection import describe_origins
        from .status import ORIGIN
        if not opts.quiet:
            click.echo("\nlocal vs accumulated error (the reference's values injected):")
            click.echo(describe_origins(origins, unexplained=not summary.ok
                                        or summary.cannot_tell))
        found = (origins["verdict"] == ORIGIN).any() or not summary.arguments.empty
        return EXIT_DIFFERENT if found else EXIT_SAME
    return EXIT_SAME if summary.ok else EXIT_DIFFERENT


def ranks_command(a: Path, b: Optional[Path], opts: Options) -> int:
    """``h5cmp RUN --ranks``: the ranks of one distributed dump against its lowest rank."""
    from .errors import DumpError
    from .ranks import compare_ranks, describe, first_disagreement
    asked = [name for name, given in (
        ("a second dump", b is not None), ("--rtol/--atol", (opts.rtol, opts.atol) != (None, None)),
        ("--rank", opts.rank is not None), ("-o", bool(opts.outputs)),
        ("--plot/--heatmap/--dot", any((opts.plot, opts.heatmap, opts.dot))),
        ("--injected", opts.injected is not None), ("--map", opts.mapping is not None),
        ("--suggest-map", opts.suggest_map), ("--scheduler", opts.scheduler is not None))
        if given]
    if asked:
        raise DumpError(f"--ranks compares the ranks of one dump, exactly; it does not take "
                        f"{', '.join(asked)} (it takes --step, --module, --kind, --jobs, -q)")
    result = compare_ranks(a, steps=opts.steps, modules=opts.modules, kinds=opts.kinds,
                           jobs=opts.jobs)
    if not opts.quiet:
        click.echo(describe(result))
    return EXIT_SAME if first_disagreement(result) is None else EXIT_DIFFERENT


def _step_spec(value: str) -> str:
    """A ``--step`` value, checked: ``S`` or ``E:S``."""
    if not fmt.STEP_SPEC.fullmatch(value):
        raise click.BadParameter(f"{value!r} is no step; give S or E:S, e.g. 3 or 0:3")
    return value


def _track(a: Path, spec: str, plot: Optional[Path]) -> None:
    from .errors import DumpError
    from .plot import plot_tensor_steps
    parts = spec.split(":")
    if plot is None or len(parts) not in (3, 4) or not all(p.isdigit() for p in parts[2:]):
        raise DumpError(f"--track {spec}: give MODULE:KIND:INDEX[:CALL] (e.g. layer1.0:output:0) "
                        f"and a --plot FILE.png")
    module = "" if parts[0] in ("", "<root>") else parts[0]
    plot_tensor_steps(a, module, parts[1], int(parts[2]), plot,
                      call_idx=int(parts[3]) if len(parts) == 4 else 0)


if __name__ == "__main__":
    main()
