"""The `benchlib` command's subcommands, one module per family: `running` (run, list, notebooks),
`model_files` (new, fit) and `results` (runs, compare, history, report, merge-records). Each module's
`add_commands(commands, common)` adds its parsers and sets each one's `handler(arguments) -> exit status`;
`benchlib.runner.cli` only parses (the families in its `FAMILIES` order), dispatches and turns errors into one
line."""
