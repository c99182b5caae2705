"""Plain (Ray-free) building blocks of the EAGLE-3 job: configs, schemas, stage logic.

Actors in `actors/` wrap these for Ray; drivers in `ray_jobs/` wire them together.
Nothing here imports vllm at module level, and the config/schema modules import no torch.
"""
