"""The benchmark suite (algorithms.md 12, "ddp-bench"): models x runs on the simulated heterogeneous rig.

``python -m flodl_exp.bench [--quick | preset=quick|full] [overrides]`` runs every (model, run) pair of
the suite as an MLflow child of one parent run, then writes the report (markdown + PNGs) into the output
folder and logs it on the parent.

* ``suite.py``: the typed config (ConfigStore group ``flodl_bench``) and the run plan;
* ``runner.py``: one run, in this process (flodl_exp through the launcher; DDP / torch solo through ``ddp.py``);
* ``ddp.py``: PyTorch DistributedDataParallel (and a plain solo loop) on any experiment preset;
* ``collect.py``: the children's metrics and files as report rows;
* ``report.py``: the sections and their math (pure); ``plots.py``: the PNGs.
"""
