"""One module per `llmobs-agent` subcommand; see llmobs.cli."""
