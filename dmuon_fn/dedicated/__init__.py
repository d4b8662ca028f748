"""The object API: `dedicate_params`, the entries, the scheduler that gathers and reduces,
the module hooks, the HSDP publish, the FSDP2 adapter and `Muon`."""
