"""Publishing: how any writer makes a dataset visible at a destination, whatever files it
writes (tar shards, token ``.bin``/``.idx`` parts, index tables): one writer per
destination, names journaled before their first byte, temporaries named by the writer's
token, and a commit whose manifest is written last. ``pack``, ``ShardWriter``, ``join``,
``index_shards``, the Ray sink and the token packer all publish through this face.

A writer of any file kind follows these steps::

    with WriterLock(open_store(dest, storage_options)) as lock:   # one writer per destination
        store = lock.store               # writes through it carry the lock's token
        check_destination(store, overwrite, resumable=True, files=MY_FILES)
        work = Journal(store, fingerprint(plan), overwrite, files=MY_FILES)
        if not work.committed:           # else: killed after its manifest; clean up only
            for name in parts_to_write(work.done()):       # a rerun skips finished parts
                journal_name(store, name, lock.token)       # only where names are not fixed by the plan
                write the part through store.open_writer(name), or into a file named
                storage.temporary_name(lock.token, name) beside it, renamed into place
                work.record(name, {"record": ..., ...})     # what a rerun finds in done()
            commit(lock, write_index_files_and_return_manifest, manifest=MY_FILES.manifest)
        work.remove()                    # after the manifest: the journal goes, plan last

- One writer per destination: :class:`WriterLock` (over ``storage.WriterLease``: a
  ``flock`` locally, a lease with a heartbeat and conditional writes on object stores). It
  journals its token in the lock file before any temporary named by it exists, and deletes
  the temporaries of earlier holders (in :data:`TEMPORARY_FOLDERS`) when it takes the lock;
  :meth:`WriterLock.check` refuses a writer whose lease was taken over. Worker processes
  call :func:`die_with_parent` (with :meth:`WriterLock.inherited_fd`) so the lock dies with
  the writer, kill -9 included.
- The journal (:class:`Journal`, the ``_pack/`` folder): the plan's :func:`fingerprint`
  (a rerun of the same plan resumes, another plan is refused unless ``overwrite``), a
  record per finished part, and the names a writer whose file names are not fixed by its
  plan (a Ray write task, a retried attempt) journals before their first byte
  (:func:`journal_name`), so that :meth:`Journal.discard` deletes exactly the files no
  finished part claims, and :meth:`WriterLock.remove_temporaries` the writer's own
  temporaries.
- What a destination holds (:class:`DatasetFiles`: a kind of writer's part-file names,
  index files and manifest; :data:`SHARD_FILES` for sample datasets): a writer refuses a
  destination holding a dataset or files at its names that no journal of ours accounts
  for (:func:`check_destination`), and ``overwrite`` deletes only those names, manifest
  first (:func:`retract_dataset`). Parts written on N machines go to :func:`part_dir`.
- The commit (:func:`commit`): the lease checked, the index files written, the manifest
  last (a dataset without a manifest does not exist for readers). A sample dataset's index
  (``shards.parquet``, ``samples.parquet``) is :func:`write_index_files`; :func:`write_index`
  writes it and its manifest without a lock.
- A series of tar shards (:class:`ShardSeries`) rolled over by the one shard-limit rule
  (:class:`ShardLimits`; the keywords ``shard_bytes``/``shard_samples`` and their other
  spellings, :func:`shard_limits`), and the options of its writers checked in one place
  (:func:`writer_options`: ``ShardWriter``, the Ray sink).
- A writer's arguments (:mod:`.options`): each checked, named with its flag, as a
  ``PackOptionError`` (``bad_option``, ``option_int``, ``checked_compression``, ...,
  ``parse_part``).

Modules: ``layout`` (journal folder, part folders, :class:`DatasetFiles`), ``lock``,
``journal``, ``commit``, ``series``, ``options``. May import :mod:`datapipe.format`,
:mod:`datapipe.storage`, :mod:`datapipe.errors`; never the packer, the dataset reader, the
loader, the cache or the checkpoint. Other packages import the names below from here.
"""

from .commit import check_destination, commit, retract_dataset, write_index, write_index_files
from .journal import Journal, fingerprint, journal_name
from .layout import JOURNAL_FILES, LEASE, LOCK, PLAN, RECORDS, SHARD_FILES, WORK, DatasetFiles, part_dir
from .lock import LEASE_STALE_S, TEMPORARY_FOLDERS, WriterLock, die_with_parent
from .options import (
    ZSTD_LEVELS,
    bad_option,
    checked_compression,
    checked_level,
    checked_storage_options,
    checked_workers,
    option_flag,
    option_int,
    option_path,
    parse_part,
)
from .series import (
    DEFAULT_SHARD_BYTES,
    DEFAULT_SHARD_SAMPLES,
    MIN_SHARD_BYTES,
    UNSET_BYTES,
    UNSET_SAMPLES,
    ShardLimits,
    ShardSeries,
    WriterOptions,
    oversized_samples,
    shard_limits,
    writer_options,
)

__all__ = [
    # one writer per destination
    "WriterLock", "LEASE_STALE_S", "TEMPORARY_FOLDERS", "die_with_parent",
    # the journal
    "Journal", "fingerprint", "journal_name",
    # what a destination holds
    "DatasetFiles", "SHARD_FILES", "WORK", "PLAN", "LOCK", "LEASE", "JOURNAL_FILES", "RECORDS", "part_dir",
    # refusing, retracting, committing
    "check_destination", "retract_dataset", "commit", "write_index", "write_index_files",
    # a series of shards and its limits
    "ShardSeries", "ShardLimits", "shard_limits", "oversized_samples", "UNSET_BYTES", "UNSET_SAMPLES",
    "WriterOptions", "writer_options",
    "DEFAULT_SHARD_BYTES", "DEFAULT_SHARD_SAMPLES", "MIN_SHARD_BYTES",
    # a writer's arguments
    "bad_option", "option_int", "option_flag", "option_path", "checked_compression", "checked_level",
    "checked_workers", "checked_storage_options", "parse_part", "ZSTD_LEVELS",
]
