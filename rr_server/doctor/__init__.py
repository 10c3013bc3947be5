"""``rr-server doctor URL``: prove, in seconds, that a running server's routing is right.

Identity and known bugs, live routing checks, ground truth against the checkpoint's own router
(``--model-path``) and the cost of routing. Prints PASS or FAIL first; every FAIL names its cause.
Exit code 0 on PASS, 1 on FAIL, 2 on bad usage.
"""

from __future__ import annotations

from rr_client import settings

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence

__all__ = ["main", "build_parser", "render"]


def build_parser() -> argparse.ArgumentParser:
    """Command-line options of ``rr-server doctor``."""
    p = argparse.ArgumentParser(prog="rr-server doctor", description=(__doc__ or "").splitlines()[0])
    p.add_argument("url", help="an rr server (patched vLLM/SGLang or the sidecar), or an engine with --engine")
    p.add_argument("--engine", choices=("vllm", "sglang"), default=None,
                   help="URL is an unpatched engine with capture on; it is checked through an in-process sidecar")
    p.add_argument("--model-path", default=None, help="the served HF checkpoint: compare with each MoE layer's own selection in "
                                                         "transformers (what the engine should have routed)")
    p.add_argument("--device", default="cpu", help="where the ground-truth forward runs (cpu, cuda)")
    p.add_argument("--prompts", type=int, default=4, help="distinct prompts used by the checks (>= 4)")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--api-key", default=None, help="Bearer key for the server (also env RR_API_KEY)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def render(report: object) -> str:
    """The human-readable report: the verdict line first, then what each part found."""
    from rr_server.doctor.checks import DoctorReport

    assert isinstance(report, DoctorReport)
    out = [f"{'PASS' if report.ok else 'FAIL'}  rr doctor: {report.url} ({report.deployment})"]
    out += [f"  FAIL {c.name}: {c.detail}" for c in report.failures()]
    ident = report.identity
    if ident:
        out.append(f"\nidentity: {ident.get('engine')} {ident.get('engine_version')}, model {ident.get('model')!r}, "
                   f"{ident.get('num_hidden_layers')} layers, MoE layers {ident.get('moe_layers')}, "
                   f"{ident.get('num_experts')} experts, top-{ident.get('topk')}, wire {ident.get('wire_dtype')}")
        out.append("known routing bugs of this version:" if report.known_bugs else "known routing bugs: none listed")
        out += [f"  - {b.what}: {b.coverage}" + (f" [{b.source}]" if b.source else "") for b in report.known_bugs]
    out.append("\nchecks:")
    out += [f"  {'n/a ' if not c.exercised else 'ok  ' if c.ok else 'FAIL'} {c.name:<22} {c.detail}"
            for c in report.checks]
    gt = report.ground_truth
    if gt:
        out.append(f"\nground truth ({gt['model_path']}, {gt['samples']} samples): {100 * gt['agreement']:.2f}% agree")
        for layer, a in sorted(gt["per_layer"].items()):
            out.append(f"  layer {layer:>3}: {100 * a['agreement']:6.2f}%")
    if report.cost:
        c = report.cost
        if "error" in c:
            out.append(f"\ncost: not measured ({c['error']})")
        else:
            out.append(f"\ncost ({c['rounds']} rounds x {c['requests_per_round']} requests, medians): "
                       f"reply {c['bytes_per_token_with']:.1f} B/token with routing vs {c['bytes_per_token_without']:.1f} "
                       f"without; latency {c['latency_ms_with']:.1f} ms vs {c['latency_ms_without']:.1f} ms per request")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the doctor and print its report."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.prompts < 4 or args.max_new_tokens < 1:
        sys.stderr.write("rr-server doctor: --prompts must be >= 4 and --max-new-tokens >= 1\n")
        return 2
    from rr_server.doctor.checks import run_doctor

    report = asyncio.run(run_doctor(
        args.url, api_key=args.api_key or settings.text("RR_API_KEY"), engine=args.engine,
        model_path=args.model_path, prompts=args.prompts, max_new_tokens=args.max_new_tokens, device=args.device))
    print(json.dumps(report.as_dict(), indent=2, default=str) if args.json else render(report))
    return 0 if report.ok else 1
