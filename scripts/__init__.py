"""Command-line tools beside the job: the CPU install's helper and the demo's real-target builder."""
