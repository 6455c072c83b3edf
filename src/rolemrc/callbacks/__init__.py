"""Training callbacks, each picked from ``conf/callbacks/<name>.yaml`` and composable:
``python train.py callbacks=[default,judge_scores,activation_maps]``.

- ``judge_scores``: generation on a test subset -> reference metrics + LLM judge -> scalars, W&B table, files.
- ``activation_maps``: activation-frequency maps (and their change since the start) -> W&B images, files.
"""
