"""The model summary printed when fit starts: Lightning's table of modules and parameter counts,
without its FLOPs. Lightning counts FLOPs only for a module with an ``example_input_array`` (one
forward on it), which rolemrc's modules have not (their inputs are batches of any length), so its
own summary would say ``Total FLOPs: 0`` on every run. Training FLOPs per token, from the model
config and the batches' real lengths, are what ``callbacks=throughput`` logs (``perf/mfu``)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import get_formatted_model_size, get_human_readable_count


class ModelSummaryWithoutFlops(ModelSummary):
    """Lightning's ``ModelSummary`` as a Rich table (as Lightning's default with Rich installed),
    the FLOPs column and total left out unless Lightning counted some."""

    @staticmethod
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int,
                  **summarize_kwargs: Any) -> None:
        columns = [(name, values) for name, values in summary_data if name != "FLOPs" or total_flops]
        totals = [
            ("Trainable params", get_human_readable_count(int(trainable_parameters))),
            ("Non-trainable params", get_human_readable_count(int(total_parameters - trainable_parameters))),
            ("Total params", get_human_readable_count(int(total_parameters))),
            ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
            ("Modules in train mode", str(total_training_modes["train"])),
            ("Modules in eval mode", str(total_training_modes["eval"])),
        ]
        if total_flops:
            totals.append(("Total FLOPs", get_human_readable_count(int(total_flops))))
        from rich import get_console
        from rich.table import Table

        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for name, _ in columns:
            numeric = name in ("Params", "Params per Device", "FLOPs", "In sizes", "Out sizes")
            table.add_column(name, justify="right" if numeric else "left", style="dim" if name == " " else None,
                             no_wrap=name == "Name")
        for row in zip(*(values for _, values in columns)):
            table.add_row(*(str(v) for v in row))
        console = get_console()
        console.print(table)
        grid = Table.grid(expand=True)
        grid.add_column()
        for label, value in totals:
            grid.add_row(f"[bold]{label}[/]: {value}")
        console.print(grid)
