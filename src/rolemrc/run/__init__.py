"""A training run's life, start to end, in the order it happens (``python train.py``):

1. **compose and check the config**: ``train.py`` composes it (Hydra) and checks it once before
   the slow imports (:func:`rolemrc.config.check_train_config`, unknown ``+`` keys included);
   :func:`rolemrc.run.train.check_files` names the files the config reads before the model loads;
   :func:`rolemrc.run.train.setup` then types it once (:class:`rolemrc.config.TrainParts`), and
   everything below is handed the parts it reads.
2. **choose or continue the run folder**: ``ckpt_path=last`` picks the folder to continue before
   Hydra starts, records what a continuation changes, holds the folder's lock and says when a run
   is finished (:mod:`rolemrc.run.resume`).
3. **size**: ``model.gradient_checkpointing=auto`` -> on/off from the stored simulated peak,
   simulated only when none of the run's shape is stored (:mod:`rolemrc.sizing.decide`, handed
   the run's module builder and world size by :func:`rolemrc.run.train.setup`).
4. **build** the parts: datamodule, LightningModule, trainer with its strategy, loggers and
   callbacks (:mod:`rolemrc.run.build`, :mod:`rolemrc.run.strategies`).
5. **fit** and export, the end-of-run summary (:mod:`rolemrc.run.train`: ``setup`` -> ``fit``).
6. **interrupt and resume**: what a checkpoint holds beyond weights, optimizer and the sampler's
   place (RNG, schedule, an epoch cut short, a checkpoint at a Ctrl-C/SIGTERM step boundary:
   :mod:`rolemrc.run.state`); the sampler's place is the sampler's (:mod:`rolemrc.data.sampler`).
7. **requeue** on SLURM: checkpoint at a step boundary, ``scontrol requeue``
   (:mod:`rolemrc.run.requeue`).

Storage of checkpoints (atomic save, lookup, reading, the look before loading) is
:mod:`rolemrc.checkpointing`'s; what every entry script shares (one-line errors, sweep jobs
recorded) is :mod:`rolemrc.entry` and :mod:`rolemrc.sweep`. This ``__init__`` imports nothing:
``train.py`` imports :mod:`rolemrc.run.resume` before Hydra starts, without Lightning.
"""
