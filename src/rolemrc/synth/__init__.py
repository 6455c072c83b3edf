"""RoleMRC-style data synthesis: personas -> profiles -> match -> dialogues -> assemble.

Entry point: ``python synthesize.py`` (Hydra, ``conf/synthesize.yaml``); in code,
``rolemrc.synth.pipeline.run(rolemrc.synth.config.load_config(cfg))``.
"""
