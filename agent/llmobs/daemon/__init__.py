"""`llmobs-agent run`: the host daemon. Modules, one job each: config (TOML + LLMOBS_* + flags, validated
once), discovery (ProcWatcher over /proc), fleet (the targets sharing one loaded BPF program), notify
(sd_notify over $NOTIFY_SOCKET), service (the main loop, signals, reload, drain)."""
