"""Services outside the cluster under the run's quotas: one scheduler per service (``scheduler.py``, a Ray actor)
keeping its quota (``quota.py``); plugins call them through ``marl_pipeline.environment.service``."""
