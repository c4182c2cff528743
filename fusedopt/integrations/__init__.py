"""Integrations with training frameworks. Each lives in its own module and is the only place that
imports its framework: ``import fusedopt`` never imports one."""
