"""The compact CPU decision model: frozen all-MiniLM-L6-v2 + a head from Clef's parts, for the built-in catalog.

See ``docs/compact-model.md`` and ``docs/catalog.md``. The backend is :class:`guard.backends.compact.CompactBackend`.
"""

from __future__ import annotations

from guard.compact.catalog import CATALOG, HARM_SEVERITY_LEVELS, CatalogQuestion, catalog_ids, catalog_question

__all__ = ["CATALOG", "HARM_SEVERITY_LEVELS", "CatalogQuestion", "catalog_ids", "catalog_question"]
