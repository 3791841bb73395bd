"""`chunkcache bench` / `chunkcache eval`: the A/B harness against stock prefix caching and the quality sweep.

Talks HTTP to the servers it starts (never imports sglang); the reference-path sweep runs the torch reference
blender in-process."""
