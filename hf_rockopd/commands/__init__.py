"""The `hf-rockopd` subcommands: each one's options (dataclasses) and the function that runs it.

`parsing` holds the one command-line dialect (TRL's `TrlParser`: dataclass fields as `--flags`, `--config file.yaml`);
`lab` the `analyze` steps, `evaluate` the `eval` command, `card` the model card, `distill` the main job's command line.
`hf_rockopd.cli` dispatches a subcommand name to one of these.
"""
