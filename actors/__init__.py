"""Thin Ray actors: process setup (devices, environment, engine start), then delegation to
plain classes in `eagle3/` that are testable without Ray. Classes here are undecorated;
`ray.remote(...)` is applied where they are placed (ray_jobs/)."""
