"""Object stores: one protocol (`ddiloco.store.base.Store`), three backends, chosen by URL
(`ddiloco.store.url.open_store`): memory://NAME, file:///abs/dir (or a plain path), s3://bucket[/prefix].

Every store has `create(key, data) -> bool`, an atomic write-once (see base.Store.create). The errors
(`StoreError`, `NotFound`, ...) live in `ddiloco.store.base`, the backends in `memory`, `file` and `s3`, the
retry policy in `retry`; wrappers (outages, shaped links) in `wrapped` and `shaped`.
"""
