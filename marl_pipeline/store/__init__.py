"""The experience store: every stage's output as hive-partitioned Arrow datasets, committed atomically.

``ExperienceStore`` is the entry point (docs/store.md); the modules below it hold the schema, the
filesystem, the commit protocol, and the read-only views (validation, inspection, summaries).
"""

from marl_pipeline.store.experience import ExperienceStore, MicroBatchKey, StoreError

__all__ = ["ExperienceStore", "MicroBatchKey", "StoreError"]
