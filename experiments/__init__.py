"""Examples and benchmark scripts (bench_*.py, ddp_baseline.py).

The experiment modules the presets name (digits, the model zoo, the cooperative loops) ship in the
package as ``flodl_exp.zoo``; a user's own experiment is one module in their project and one yaml under
their ``conf/experiment/`` (``--config-dir``). The library never imports this package.
"""
