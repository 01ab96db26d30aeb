"""The route of a call through ``src/tplogp``: which modules it enters, in how many stays, how often
it returns.

A profiler hook (``sys.setprofile``, host frames only) follows every Python call and return while
``fn`` runs and keeps the module of the innermost frame that belongs to the package (a file under
the package's folder, named by its dotted path there: ``op.plan``; code that dataclasses and named
tuples generate, file ``<string>``, belongs to none). A *stay* begins whenever that module changes
to another module of the package (time spent outside the package, in torch or the autograd engine,
does not end a stay); a *return* is a stay in a module that an earlier stay already left. Every
module counts, helpers included: ``returns = stays - modules entered``.

``python -m tests.support.route`` measures the four steady phases of the TP path with the native
source on two gloo ranks (rank 0 reports; each call is the second of its layout, so imports, probes
and plan misses are behind it): ``linear_logp``'s forward and backward, and ``linear_logp_loss``'s
(a policy-gradient loss) forward and backward. It prints, per phase, the modules entered, the stays
and the returns, then the returns in all; ``--stays`` lists every stay in order. ``PYTHONPATH``
picks the tree measured.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable, NamedTuple, Optional


class Route(NamedTuple):
    stays: list[str]  # the module of each stay, in order

    @property
    def modules(self) -> list[str]:
        return list(dict.fromkeys(self.stays))

    @property
    def returns(self) -> int:
        return len(self.stays) - len(self.modules)


def trace_route(fn: Callable[[], object], package: Path) -> Route:
    """Run ``fn`` under the hook and return its route through the modules under ``package``."""
    package = package.resolve()
    names: dict[str, Optional[str]] = {}

    def module_of(filename: str) -> Optional[str]:
        if filename not in names:
            name = None
            path = Path(filename)
            if path.is_absolute():
                try:
                    parts = path.resolve().relative_to(package).with_suffix("").parts
                except ValueError:
                    parts = None
                if parts is not None:
                    name = ".".join(p for p in parts if p != "__init__") or "__init__"
            names[filename] = name
        return names[filename]

    stays: list[str] = []
    # per open frame: the innermost package module at or above it
    innermost: list[Optional[str]] = []

    def hook(frame, event, arg):
        if event == "call":
            module = module_of(frame.f_code.co_filename)
            if module is None and innermost:
                module = innermost[-1]
            innermost.append(module)
        elif event == "return":
            if innermost:
                innermost.pop()
        else:
            return
        current = innermost[-1] if innermost else None
        if current is not None and (not stays or stays[-1] != current):
            stays.append(current)

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return Route(stays)


PHASES = ("op forward", "op backward", "fused loss forward", "fused loss backward")


def measure(rank: int, world: int, store_path: str) -> dict[str, Route]:
    """The four phases' routes on this rank (every rank runs the same calls; each traces its
    own)."""
    import torch
    import torch.distributed as dist

    import tplogp

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        package = Path(tplogp.__file__).parent
        tokens, hidden_size, vocab = 6, 16, 70
        v_local = vocab // world
        start = rank * v_local
        gen = torch.Generator().manual_seed(3)
        hidden = torch.randn(tokens, hidden_size, generator=gen)
        weight = torch.randn(vocab, hidden_size, generator=gen)[start:start + v_local]
        target = torch.randint(0, vocab, (tokens,), generator=gen)
        advantages = torch.randn(tokens, generator=gen)
        group = dict(tp_group=dist.group.WORLD, vocab_start_index=start, global_vocab_size=vocab)
        op = tplogp.get_op("linear_logp", source="native")
        loss_fn = tplogp.losses.policy_gradient()
        routes: dict[str, Route] = {}
        for measured in (False, True):  # the second call of the layout is measured
            h = hidden.clone().requires_grad_()
            w = weight.clone().requires_grad_()
            out = {}

            def step(name: str, fn: Callable[[], object]) -> None:
                if measured:
                    routes[name] = trace_route(fn, package)
                else:
                    fn()

            step("op forward", lambda: out.setdefault("logp", op(h, w, target, **group)))
            step("op backward", lambda: out["logp"].sum().backward())
            step("fused loss forward", lambda: out.setdefault("loss", tplogp.linear_logp_loss(
                h, w, target, loss=loss_fn, per_token=(advantages,), source="native", **group)))
            step("fused loss backward", lambda: out["loss"].backward())
            tplogp.check_errors()
        return routes
    finally:
        dist.destroy_process_group()


def _rank_main(rank: int, world: int, store_path: str, show_stays: bool) -> None:
    routes = measure(rank, world, store_path)
    if rank != 0:
        return
    total = 0
    for name in PHASES:
        route = routes[name]
        total += route.returns
        print(f"{name:20s} modules entered {len(route.modules):3d}  stays {len(route.stays):4d}  "
              f"returns {route.returns:4d}")
        if show_stays:
            print("    " + " > ".join(route.stays))
    print(f"{'all phases':20s} returns {total}")


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.support.route",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--stays", action="store_true", help="list every stay of each phase")
    args = parser.parse_args(argv)
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(2, os.path.join(tmp, "store"), args.stays), nprocs=2)


if __name__ == "__main__":
    main()
