"""``rr-server doctor URL``: prove, in seconds, that a running server's routing is right.

Identity and known bugs, live routing checks, ground truth against the checkpoint's own router
(``--model-path``) and the cost of routing. Each check's line goes to stderr as it finishes (on a terminal with a
spinner and the elapsed time of the running one); the report follows on stdout, PASS or FAIL first, every FAIL
naming its cause. With ``--json`` stdout holds the JSON report only (the lines on stderr only on a terminal).
Exit code 0 on PASS, 1 on FAIL, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rr_client.core import settings
from rr_client.core.engines import ENGINE_NAMES
from rr_server.progress import Steps, stderr_console
from rr_server.serving.command_line import CommandParser, url_problem

# the probes' default burst cap (rr_server.doctor.probes.MAX_PROBE_REQUESTS; that module is not imported for --help)
MAX_PROBE_REQUESTS = 48

if TYPE_CHECKING:
    from rr_server.doctor.checks import Check

__all__ = ["main", "build_parser", "render", "check_line", "CheckPrinter"]


def build_parser() -> argparse.ArgumentParser:
    """Command-line options of ``rr-server doctor``."""
    p = CommandParser(prog="rr-server doctor", description=(__doc__ or "").splitlines()[0])
    p.add_argument("url", help="an rr server (patched vLLM/SGLang or the sidecar), or an engine with --engine")
    p.add_argument(
        "--engine",
        choices=ENGINE_NAMES,
        default=None,
        help="URL is an unpatched engine with capture on; it is checked through an in-process sidecar",
    )
    p.add_argument(
        "--model-path",
        default=None,
        help="the served HF checkpoint: compare with each MoE layer's own selection in "
        "transformers (what the engine should have routed)",
    )
    p.add_argument("--device", default="cpu", help="where the ground-truth forward runs (cpu, cuda)")
    p.add_argument("--prompts", type=int, default=4, help="distinct prompts used by the checks (>= 4)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="tokens each check's request generates")
    p.add_argument("--api-key", default=None, help="Bearer key for the server (also env RR_API_KEY)")
    probes = p.add_argument_group(
        "probes",
        "after the live checks, always: preemption, kv offload (vLLM) / hierarchical cache (SGLang), bounded replay "
        "(DeepSeek-V4.1's SWA bounded replay vs a full prefill); each says 'not probed' and why where it cannot run",
    )
    probes.add_argument(
        "--probe-weight-update",
        metavar="PATH",
        default=None,
        help="reload PATH (the served weights) while requests run",
    )
    probes.add_argument(
        "--probe-requests",
        type=int,
        default=None,
        metavar="N",
        help=f"most concurrent requests a probe sends ({MAX_PROBE_REQUESTS})",
    )
    pd = p.add_argument_group(
        "prefill/decode",
        "a SGLang P/D pair of the same model: the same greedy prompts through the pair (each half checked, joined at "
        "the seam) and through URL alone must give equal rows on the prompt and on the generated tokens",
    )
    pd.add_argument("--pd-prefill", metavar="URL", default=None, help="the pair's prefill server")
    pd.add_argument("--pd-decode", metavar="URL", default=None, help="the pair's decode server")
    pd.add_argument(
        "--pd-bootstrap-port", type=int, default=None, help="the prefill server's --disaggregation-bootstrap-port"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def _status(check: Check) -> str:
    return "n/a " if not check.exercised else "ok  " if check.ok else "FAIL"


def check_line(check: Check) -> str:
    """A check as the report lists it: status, name, what it found."""
    return f"  {_status(check)} {check.name:<22} {check.detail}"


class CheckPrinter:
    """The doctor's progress on ``steps``: each check's line as it finishes, with the seconds it took."""

    def __init__(self, steps: Steps) -> None:
        self.steps = steps
        self._t0 = time.monotonic()

    def started(self, name: str) -> None:
        self._t0 = time.monotonic()
        self.steps.start(f"{name} ...")

    def finished(self, check: Check) -> None:
        self.steps.line(f"  {_status(check)} {check.name:<22} {time.monotonic() - self._t0:5.1f}s  {check.detail}")


def render(report: object, checks: bool = True) -> str:
    """The human-readable report: the verdict line first, then what each part found (``checks=False``: without the
    per-check lines, already printed as they finished)."""
    from rr_server.doctor.checks import DoctorReport

    assert isinstance(report, DoctorReport)
    out = [f"{'PASS' if report.ok else 'FAIL'}  rr doctor: {report.url} ({report.deployment})"]
    out += [f"  FAIL {c.name}: {c.detail}" for c in report.failures()]
    ident = report.identity
    if ident:
        out.append(
            f"\nidentity: {ident.get('engine')} {ident.get('engine_version')}, model {ident.get('model')!r}, "
            f"{ident.get('num_hidden_layers')} layers, MoE layers {ident.get('moe_layers')}, "
            f"{ident.get('num_experts')} experts, top-{ident.get('topk')}, wire {ident.get('wire_dtype')}"
        )
        out.append("known routing bugs of this version:" if report.known_bugs else "known routing bugs: none listed")
        out += [f"  - {b.what}: {b.coverage}" + (f" [{b.source}]" if b.source else "") for b in report.known_bugs]
    if checks:
        out.append("\nchecks:")
        out += [check_line(c) for c in report.checks]
    gt = report.ground_truth
    if gt:
        out.append(f"\nground truth ({gt['model_path']}, {gt['samples']} samples): {100 * gt['agreement']:.2f}% agree")
        for layer, a in sorted(gt["per_layer"].items()):
            out.append(f"  layer {layer:>3}: {100 * a['agreement']:6.2f}%")
    from rr_server.doctor.pd import render_seams

    out += render_seams(report.seams)
    if report.cost:
        c = report.cost
        if "error" in c:
            out.append(f"\ncost: not measured ({c['error']})")
        else:
            out.append(
                f"\ncost ({c['rounds']} rounds x {c['requests_per_round']} requests, medians): "
                f"reply {c['bytes_per_token_with']:.1f} B/token with routing vs {c['bytes_per_token_without']:.1f} "
                f"without; latency {c['latency_ms_with']:.1f} ms vs {c['latency_ms_without']:.1f} ms per request"
            )
    return "\n".join(out)


def _model_path_problem(value: str) -> str | None:
    """Why ``--model-path`` cannot give ground truth, in a clause (the launchers' own check), or None; a hub id
    (``ORG/NAME``) is left to the loader."""
    from rr_server.launch.options import local_path, model_folder_problem

    return model_folder_problem(value) if local_path(value) or "/" not in value else None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the doctor and print its report."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.prompts < 4 or args.max_new_tokens < 1 or (args.probe_requests is not None and args.probe_requests < 2):
        sys.stderr.write("rr-server doctor: --prompts must be >= 4, --max-new-tokens >= 1, --probe-requests >= 2\n")
        return 2
    if args.model_path is not None and (why := _model_path_problem(args.model_path)):
        sys.stderr.write(f"rr-server doctor: --model-path {args.model_path}: {why}\n")
        return 2
    if why := url_problem(args.url):
        sys.stderr.write(f"rr-server doctor: {why} (the server's)\n")
        return 2
    pd_args = (args.pd_prefill, args.pd_decode, args.pd_bootstrap_port)
    if any(a is not None for a in pd_args) and (None in pd_args or args.pd_bootstrap_port < 1):
        sys.stderr.write("rr-server doctor: --pd-prefill, --pd-decode and --pd-bootstrap-port go together\n")
        return 2
    from rr_server.doctor.checks import run_doctor
    from rr_server.doctor.pd import PDTarget

    console = stderr_console()
    quiet = args.json and not console.is_terminal  # a JSON report for machines: no lines beside it
    with Steps(console) as steps:
        if not quiet:
            steps.line(f"rr doctor: checking {args.url} (each check as it finishes; the report follows)")
        report = asyncio.run(
            run_doctor(
                args.url,
                api_key=args.api_key or settings.text("RR_API_KEY"),
                engine=args.engine,
                model_path=args.model_path,
                prompts=args.prompts,
                max_new_tokens=args.max_new_tokens,
                device=args.device,
                progress=None if quiet else CheckPrinter(steps),
                probe_weight_update=args.probe_weight_update,
                probe_requests=args.probe_requests,
                pd=PDTarget(args.pd_prefill, args.pd_decode, args.pd_bootstrap_port) if args.pd_prefill else None,
            )
        )
    print(json.dumps(report.as_dict(), indent=2, default=str) if args.json else render(report))
    return 0 if report.ok else 1
