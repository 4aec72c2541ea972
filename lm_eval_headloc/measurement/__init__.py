"""One measurement: task scores through lm-eval with some components knocked out, and
attribution patching's estimates of every component's effect."""
