"""``h5cmp``: compare two dumps (or list one). Exit codes like h5diff: 0 = all within tolerance,
1 = differences found, 2 = error."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import click

from . import format as fmt

EXIT_SAME, EXIT_DIFFERENT, EXIT_ERROR = 0, 1, 2


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("a", type=click.Path(path_type=Path, readable=False))
@click.argument("b", type=click.Path(path_type=Path, readable=False), required=False)
@click.option("--rtol", type=float, help="Relative tolerance for every pair (default: per dtype).")
@click.option("--atol", type=float, help="Absolute tolerance for every pair (default: per dtype).")
@click.option("--step", "steps", multiple=True, help="Only step S, or E:S (repeatable).")
@click.option("--module", "modules", multiple=True, help="Only modules matching this glob (repeatable).")
@click.option("--kind", "kinds", multiple=True, type=click.Choice(fmt.KINDS),
              help="Only records of this kind (repeatable).")
@click.option("-o", "--output", type=click.Path(path_type=Path),
              help="Write every row to FILE: .csv, .json, .html or .xlsx (needs h5cmp[xlsx]).")
@click.option("--plot", type=click.Path(path_type=Path),
              help="Draw errors in execution order to FILE.png (needs h5cmp[plot]).")
@click.option("--heatmap", type=click.Path(path_type=Path),
              help="Draw a modules x steps heat map of rel_l2_err to FILE.png (needs h5cmp[plot]).")
@click.option("--dot", type=click.Path(path_type=Path),
              help="Write the first compared step's call graph, coloured by status, to FILE.dot "
                   "(.png/.svg rendered with Graphviz).")
@click.option("--injected", type=click.Path(path_type=Path),
              help="A dump of run B with reference inputs injected (dumper.Injector): report each "
                   "module's local error and whether it is the origin or inherits the error.")
@click.option("--track", metavar="MODULE:KIND:INDEX[:CALL]",
              help="With only A: plot this tensor over A's steps into the --plot file.")
@click.option("--rank", type=click.IntRange(min=0),
              help="Distributed rank to compare (default: rank by rank; a non-distributed dump "
                   "is compared with the lowest rank of the other).")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=1, show_default=True,
              help="Compare in N processes.")
@click.option("--all", "show_all", is_flag=True, help="Show every row, not only failing ones.")
@click.option("--top", type=click.IntRange(min=1), default=20, show_default=True,
              help="Show at most N rows.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing; only the exit code tells.")
def main(a: Path, b: Optional[Path], rtol, atol, steps, modules, kinds, output, plot, heatmap,
         dot, injected, track, rank, jobs, show_all, top, quiet) -> None:
    """Compare dumps A and B (files or directories of step files) tensor by tensor and report
    the first divergence. With only A, list its steps, module calls and tensors.

    Exit status: 0 all pairs within tolerance, 1 differences found, 2 error.
    """
    from .errors import DumpError
    try:
        if b is None:
            if track:
                _track(a, track, plot)
            else:
                from .inspect import format_tree
                click.echo(format_tree(a))
            sys.exit(EXIT_SAME)
        sys.exit(_compare(a, b, rtol, atol, steps, modules, kinds, output, plot, heatmap, dot,
                          injected, rank, jobs, show_all, top, quiet))
    except DumpError as exc:
        click.echo(f"h5cmp: error: {exc}", err=True)
        sys.exit(EXIT_ERROR)


def _compare(a, b, rtol, atol, steps, modules, kinds, output, plot, heatmap, dot, injected, rank,
             jobs, show_all, top, quiet) -> int:
    from .comparison import compare_dumps
    from .dump import load_dump
    from .pairing import align_ranks
    from .report import export, render_text
    from .summary import summarize

    from .plot import check_plot_path, plot_errors, plot_heatmap
    from .report import check_output_path

    if output is not None:
        check_output_path(output)
    for picture in (plot, heatmap):
        if picture is not None:
            check_plot_path(picture)
    dump_a, dump_b, note = align_ranks(load_dump(a), load_dump(b), rank)
    if note and not quiet:
        click.echo(f"h5cmp: {note}", err=True)
    _report_unpaired_steps(dump_a, dump_b, quiet)
    show_progress = not quiet and sys.stderr.isatty()
    total = int((dump_a.index["dataset"] != "").sum())
    with click.progressbar(length=total, label="comparing", file=sys.stderr,
                           hidden=not show_progress) as bar:
        result = compare_dumps(dump_a, dump_b, rtol, atol, steps=steps, modules=modules,
                               kinds=kinds, jobs=jobs, progress=bar.update)
    summary = summarize(result)
    if output is not None:
        export(result, summary, output)
    if plot is not None:
        plot_errors(result, summary, plot)
    if heatmap is not None:
        plot_heatmap(result, heatmap)
    if dot is not None:
        from .dataflow import to_dot, write_dot
        first = result.iloc[0] if len(result) else None
        write_dot(to_dot(dump_a, *(() if first is None else (first["epoch"], first["step"])),
                         result=result), dot)
    if not quiet:
        click.echo(render_text(result, summary, show_all, top))
    if injected is not None:
        from .localize import describe_origins, localize
        origins = localize(dump_a, dump_b, injected, rtol, atol, steps=steps, modules=modules)
        if not quiet:
            click.echo("\nlocal vs accumulated error (with reference inputs injected):")
            click.echo(describe_origins(origins))
    return EXIT_SAME if summary.ok else EXIT_DIFFERENT


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


def _report_unpaired_steps(dump_a, dump_b, quiet: bool) -> None:
    keys_a = {(s.epoch, s.step, s.rank) for s in dump_a.steps}
    keys_b = {(s.epoch, s.step, s.rank) for s in dump_b.steps}
    if quiet:
        return
    for side, extra in (("A", keys_a - keys_b), ("B", keys_b - keys_a)):
        for epoch, step, rank in sorted(extra, key=lambda k: (k[0], k[1], k[2] or 0)):
            rank_text = "" if rank is None else f" rank {rank}"
            click.echo(f"h5cmp: step {epoch}:{step}{rank_text} is only in {side}", err=True)


if __name__ == "__main__":
    main()
