"""Sizing a training run: how much GPU memory one rank needs, and ``model.gradient_checkpointing=auto``.

- :mod:`rolemrc.sizing.formula`: the back-of-the-envelope estimate per device (no torch model
  built), logged by every training run's setup and printed by ``python -m rolemrc.memory``;
- :mod:`rolemrc.sizing.simulate`: one optimizer step of the run simulated under fake tensors on
  fake ranks (the per-rank peak by category), built with the module builder its caller hands it;
  also the child process a training run simulates in (``python -m rolemrc.sizing.simulate``);
- :mod:`rolemrc.sizing.decide`: the run's decision for ``auto``, from the simulated peak stored
  under ``$ROLEMRC_CACHE_DIR/sizing`` by a key of what it depends on, simulated on a miss;
- :mod:`rolemrc.sizing.result`: what a simulation gives back (no torch).

The package imports nothing of the run (:mod:`rolemrc.run`): the run hands it its module builder
(``build_module``) and its world size; the command line is :mod:`rolemrc.memory`. This
``__init__`` imports nothing.
"""
