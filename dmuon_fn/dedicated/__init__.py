"""The object API: `dedicate_params`, its entries, scheduler, hooks and FSDP2 adapter, `Muon`."""
