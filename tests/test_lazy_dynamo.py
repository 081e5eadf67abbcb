"""A rank's optimizers import no ``torch._dynamo`` until something compiles (flodl_exp/rank/lazy_dynamo.py).

One fresh interpreter (the pytest process has dynamo loaded by other tests): the optimizers a rank builds train,
save and load their state, take a new param group and a scheduler with dynamo never imported; then dynamo is
imported, the same training from the same seed gives the same numbers on torch's own path (the wrappers handed
back), and a ``torch.compile``-d step runs.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from conftest import ROOT

_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    from flodl_exp.rank.lazy_dynamo import ENV, defer_optimizer_dynamo

    os.environ[ENV] = "0"
    assert defer_optimizer_dynamo() == 0, "turned off by its environment variable"
    del os.environ[ENV]
    from torch.optim import optimizer as optimizer_module
    moved = optimizer_module._use_grad_for_differentiable
    del optimizer_module._use_grad_for_differentiable
    assert defer_optimizer_dynamo() == 0, "a torch whose internals moved keeps its own code, and the rank runs"
    optimizer_module._use_grad_for_differentiable = moved
    changed = defer_optimizer_dynamo()
    assert defer_optimizer_dynamo() == 0, "a second call changes nothing"
    OPTIMIZERS = [(torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)), (torch.optim.Adam, dict(lr=1e-2)),
                  (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)), (torch.optim.RMSprop, dict(lr=1e-2)),
                  (torch.optim.Adagrad, dict(lr=1e-2))]

    def train():
        torch.manual_seed(0)
        out = []
        for cls, kw in OPTIMIZERS:
            model = torch.nn.Linear(4, 3)
            opt = cls(model.parameters(), **kw)
            sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(5, 4)).pow(2).sum().backward()
                opt.step()
                assert torch.is_grad_enabled(), "the step restores the grad mode"
                sched.step()
            again = cls(model.parameters(), **kw)
            again.load_state_dict(opt.state_dict())
            again.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
            model(torch.randn(5, 4)).sum().backward()
            again.step()
            out.append([round(v, 7) for v in model.weight.flatten().tolist()])
        return out

    eager = train()
    zero_grad = torch.optim.Optimizer.zero_grad.__wrapped__
    report = {"changed": changed, "dynamo_after_training": "torch._dynamo" in sys.modules,
              "cache_eager": type(getattr(zero_grad, "__dynamo_disable")).__name__}
    import torch._dynamo
    report["same_on_torchs_path"] = train() == eager
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    before = model.weight.detach().clone()

    @torch.compile(backend="eager")
    def compiled_step():
        opt.step()

    model(torch.randn(5, 4)).sum().backward()
    compiled_step()
    report["compiled_step_trained"] = not torch.equal(before, model.weight.detach())
    # torch's own wrappers again: the step places its two graph breaks, every cached stand-in is gone
    breaks = []
    graph_break = torch._dynamo.graph_break
    torch._dynamo.graph_break = lambda *a, **k: breaks.append(1) or graph_break(*a, **k)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    torch._dynamo.graph_break = graph_break
    report["graph_breaks_per_step"] = len(breaks)
    opt.load_state_dict(opt.state_dict())
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    opt.zero_grad()
    report["caches_now"] = sorted({type(getattr(getattr(torch.optim.Optimizer, n).__wrapped__, "__dynamo_disable",
                                                None)).__name__
                                   for n in ("add_param_group", "zero_grad", "state_dict", "load_state_dict")})
    print(json.dumps(report))
""")


def test_optimizers_train_without_dynamo_and_hand_back_to_torch_once_it_loads():
    r = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["changed"] >= 5, report  # add_param_group, zero_grad, state_dict, load_state_dict, the steps
    assert report["dynamo_after_training"] is False, report
    assert report["same_on_torchs_path"] is True, report
    assert report["compiled_step_trained"] is True, report
    assert report["cache_eager"] == "_EagerUntilDynamo", report
    assert report["graph_breaks_per_step"] == 2, report
    assert "_EagerUntilDynamo" not in report["caches_now"] and "NoneType" not in report["caches_now"], report


def test_a_wrapper_whose_body_differs_from_the_known_one_is_left_alone():
    from flodl_exp.rank.lazy_dynamo import _DISABLE_SHAPE, _USE_GRAD_SHAPE, _known

    def use_grad_for_differentiable(func):  # a future torch reading a default the eager path would not read
        def _use_grad(*args, **kwargs):
            import torch._dynamo

            differentiable = args[0].defaults.get("differentiable", False)
            torch._dynamo.graph_break()
            return func(*args, **kwargs) if differentiable is not None else None
        return _use_grad

    assert not _known(use_grad_for_differentiable(print).__code__, _USE_GRAD_SHAPE)
    assert not _known(use_grad_for_differentiable(print).__code__, _DISABLE_SHAPE)
