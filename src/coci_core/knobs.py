"""coci's tuning numbers, in one place: sizes, timeouts and intervals chosen by measurement or
by judgement, not fixed by the format (the format's limits live in
``engine/format/manifest.py``, the planner's model constants in ``planner/``). Each module
imports its numbers from here under the same name.
"""

from __future__ import annotations

MiB = 1024 * 1024

# -- the save path ---------------------------------------------------------------------
#: The unit in which a replicated state is split over ranks (engine/save/partition.py).
DEFAULT_CHUNK_BYTES = 4 * MiB
#: Writes are issued in chunks of at most this size (engine/save/persist.py).
WRITE_CHUNK_BYTES = 64 * MiB
#: A local data file is synced every this many bytes, so that the final fsync is short
#: (storage/local.py).
SYNC_EVERY_BYTES = 32 * MiB
#: Free space kept beyond a save's size before old steps are deleted early (engine/save/writer.py).
ROOM_MARGIN_BYTES = 1 * MiB

# -- compression (engine/save/compress.py) ----------------------------------------------
#: How much of a state is compressed to estimate whether compression pays.
PROBE_BYTES = 1 * MiB
#: ``compression="auto"`` never compresses saves smaller than this.
AUTO_MIN_BYTES = 16 * MiB

# -- several ranks and several writers --------------------------------------------------
#: How long rank 0 waits for every rank's share of a save before giving it up
#: (engine/group.py).
DEFAULT_COMMIT_TIMEOUT_S = 600.0
#: How long the ranks wait for each other's manager (``RankGroup.default``).
JOIN_TIMEOUT_S = 300.0
#: Each rank of a save of several says it is alive this often, through the job's store; a
#: rank seen alive, then silent for RANK_SILENT_S, is taken for dead: the save that waits for
#: it fails then, not after the commit timeout (engine/pulse.py).
PULSE_S = 1.0
RANK_SILENT_S = 30.0
#: How long a restoring rank waits for the others to say which step they could restore
#: (engine/agreement.py): long enough for the slowest rank to read and verify a large state.
RESTORE_AGREE_TIMEOUT_S = 1800.0
#: An object store's owner record not renewed for this long belongs to a dead writer; it is
#: renewed every third of it (engine/directory/lease.py).
LEASE_TTL_S = 60.0
#: Planned steps rank 0 shares at a sync step: far more than are used before the next one
#: (training/decision.py).
SCHEDULE_SENT = 64

# -- the remote tier (engine/directory/tiers.py) -------------------------------------------
#: A failed upload is retried after this long, doubling up to UPLOAD_BACKOFF_MAX_S.
UPLOAD_BACKOFF_START_S = 0.5
UPLOAD_BACKOFF_MAX_S = 30.0
#: Uploads read the local files in chunks of this size (one buffer, reused).
UPLOAD_CHUNK_BYTES = 64 * MiB
#: ``close()`` waits this long at most for a pending upload.
UPLOAD_CLOSE_TIMEOUT_S = 600.0
#: Steps kept also (``keep_also``) that may wait for their upload at once, behind newer
#: uploads: past it the oldest is left out of the remote tier, with a WARNING.
UPLOAD_KEPT_WAITING = 64

# -- object stores (storage/s3_parallel.py) ------------------------------------------------
#: The part size of multipart uploads and of parallel ranged reads (S3's minimum is 5 MiB).
S3_PART_BYTES = 16 * MiB
#: Parts uploaded (or ranges read) at once.
S3_PARALLEL = 4

# -- telemetry on an object store (telemetry/objects.py) ------------------------------------
#: The session's telemetry object is put again at most this often ...
TELEMETRY_PUT_GAP_S = 2.0
#: ... soon after a committed save, else within this long of a new record (also the wait
#: before a failed put is tried again).
TELEMETRY_PUT_DELAY_S = 30.0
#: ``close()`` waits this long at most for the last put.
TELEMETRY_CLOSE_TIMEOUT_S = 60.0

#: The least time between two progress records in a run's telemetry (how far a killed run got,
#: hence the work its restart lost, is known to about this much).
TELEMETRY_PROGRESS_EVERY_S = 1.0

# -- the planner (planner/) and the HPO integrations (hpo/) ----------------------------------
#: Re-plans on the doubling schedule of steps come at least this many steps apart
#: (planner/replanning.py).
REPLAN_MIN_GAP_STEPS = 64
#: The measured costs are compared with the planned ones every this many observed steps ...
COST_CHECK_EVERY = 64
#: ... the loss with its fitted curve (a regime change) every this many ...
REGIME_CHECK_EVERY = 256
#: ... and an untrusted loss curve is fitted again every this many, once it has
#: UNTRUSTED_MIN_LOSSES losses.
UNTRUSTED_CHECK_EVERY = 128
UNTRUSTED_MIN_LOSSES = 64
#: A cost or the MTBF that moves by more than this share of its planned value re-plans.
REPLAN_CHANGE = 0.2
#: A scheduled re-plan is skipped while every input stays this close to the planned one.
REPLAN_SETTLED = 0.05
#: The longest horizon planned at once (per-step arrays); longer runs are planned in windows.
MAX_HORIZON_STEPS = 2_000_000
#: The longest run one schedule plans at once (``plan_schedule``, ``coci plan``, the policies
#: ``coci report`` compares): longer is minutes of work and GBs of per-step arrays.
MAX_SCHEDULE_STEPS = 10 * MAX_HORIZON_STEPS

#: The last step a plan holds (a checkpoint's step is an int64).
MAX_PLAN_STEP = 2**63 - 1
#: The most nodes a planner's failure model counts (a larger count, or a callable's value beyond
#: it, is refused: the failure rate's sums would overflow a float).
MAX_NODES = 10**9
#: The largest schedule grid (``grid_points``): a re-plan's work grows with it, and the
#: training thread waits for a re-plan.
MAX_GRID_POINTS = 10_000
#: Steps of a fixed-interval policy listed ahead by ``Planner.schedule``.
FIXED_AHEAD_STEPS = 64
#: The latest measurements of each cost whose median the planner uses (planner/costs.py).
COST_WINDOWS = {
    "step_time_s": 256,
    "stall_s": 16,
    "persist_s": 16,
    "restart_s": 8,
    "loop_cost_s": 16,
}
#: The losses are kept in at most this many bins; past it, neighbours merge
#: (planner/observations.py).
LOSS_BINS_MAX = 1024
#: A persist that does not end within this many steps is not charged to them.
CHARGED_STEPS_MAX = 256
#: Raw first losses kept for the ``coci_paper`` policy.
FIRST_LOSSES_KEPT = 64
#: Timed steps before the wall time per step is used.
MIN_TIMED_STEPS = 16
#: Step end times remembered to charge an upload's overlap, and the uploads (and loop costs
#: and restarts) whose median is used (planner/upload_costs.py).
UPLOAD_STEPS_KEPT = 4096
UPLOAD_COST_WINDOW = 16
#: The least weight of a trial in the rank-weighted estimate, against 1 for the closest
#: (hpo/optuna.py) ...
MIN_RANK_WEIGHT = 0.01
#: ... and the most ASHA rungs read from an Optuna pruner.
ASHA_MAX_RUNGS = 64

# -- the snapshot and the commit across ranks (engine/save/snapshot.py, engine/save/commit.py) ---
#: With ``block=False``, regions of at most this many bytes are copied at once by ``save()``:
#: the small tensors that the next forward pass changes in place (BatchNorm's running
#: statistics, step counters) are then saved as they were.
SMALL_COPY_BYTES = 64 << 10
#: Whole leaves of at most this many bytes lie end to end at the start of the arena and are
#: copied by one ``torch.cat`` over byte views of them (one copy per tensor costs ~2 us more here);
#: larger ones start on a 64-byte boundary and are copied one by one (torch's copy of each uses
#: every intra-op thread, which ``cat``'s serial copy does not).
PACKED_COPY_BYTES = 64 << 10
#: How often the writer thread, waiting for the saving thread to check a background copy, looks
#: whether that thread has ended (then it checks the copy itself).
OWNER_POLL_S = 0.5
#: How long after a background copy ended the writer waits for the saving thread's check
#: before it checks by itself (at least this, and CHECK_GRACE_COPIES times the copy's own
#: time): an in-place op that was writing a tensor when the copy ended has long returned and
#: bumped its counter by then, and a saving thread that does not come back to coci (a rank
#: blocked in a collective, a loop that polls ``done()``) does not hold the commit up.
CHECK_GRACE_S = 5.0
CHECK_GRACE_COPIES = 10
#: The ranks poll the storage for each other's commit records first after this long, the
#: interval doubling up to COMMIT_POLL_MAX_S.
COMMIT_POLL_START_S = 0.002
COMMIT_POLL_MAX_S = 0.1

# -- reading what others wrote: torch.save'd values and imports (engine/format/torch_saved.py,
# -- interop/foreign.py, interop/exchange.py) ------------------------------------------------
#: The most levels a stored ``torch.save`` value's pickle may nest, and the most objects (each
#: shared reference counted again) per byte of it, plus a floor: a value coci saves nests at
#: most MAX_TREE_DEPTH containers, a few pickle levels each, while torch.load's unpickler
#: crashes CPython hashing a tuple key ~100,000 deep; larger, a few bytes describe millions of
#: objects.
MAX_SAVED_PICKLE_DEPTH = 1024
SAVED_PICKLE_UNITS_PER_BYTE = 16
SAVED_PICKLE_FLOOR = 1 << 16
#: What an import builds or walks is paid for by the bytes it reads, in units (an object, a
#: character, a byte of a list slot, a step of a check), plus this many for the parts every
#: checkpoint has whatever it stores (DCP's Metadata object): never enough to hurt.
IMPORT_FLOOR_UNITS = 1 << 16
#: DCP's own .metadata describes about 3 objects and characters per byte of its pickle (which
#: shares dtypes and each key among the chunks of its tensor); 16 leaves room for keys of a
#: thousand characters shared by every chunk. Data files are not counted: a sparse file can be
#: as large as it likes without storing anything.
UNITS_PER_METADATA_BYTE = 16
#: DCP's metadata objects nest about ten deep; CPython hashes and compares nested tuples
#: recursively in C, so a deep one would crash the process while .metadata is unpickled.
MAX_METADATA_DEPTH = 64
#: The longest export note (``coci_export.json``) read, in characters.
MAX_NOTE_CHARS = 1 << 28

# -- training loops and framework adapters (training/) ---------------------------------------
#: A plan of more checkpoints than this is not costed against Daly in the telemetry (about
#: 0.25 s of the telemetry thread).
MAX_CHECKPOINTS_COSTED = 500
#: An early-stopping hazard covers at most this many coming validations ...
EARLY_STOPPING_COMING_VALIDATIONS = 512
#: ... and, without a known end of the run, a horizon of this many validation intervals.
EARLY_STOPPING_ROLLING_VALIDATIONS = 256

# -- storage and restore reads (engine/restore/read.py) ------------------------------------
#: A stored piece larger than this is read from local storage in reads of this size, the
#: checksum of each computed on a helper thread while the next one is read.
READ_CHUNK_BYTES = 16 * MiB
#: Pieces from this size on are read from local storage in chunks whose pages are then dropped
#: from the page cache (smaller ones are read whole and left there).
CHUNKED_MIN_BYTES = 1 * MiB
#: A chunk whose pages are all in the page cache already is read (a copy from memory) in parts
#: of this size, each checksummed while the next is copied: the checksum of a 16 MiB read
#: would otherwise wait alone at the end of each piece.
CACHED_READ_BYTES = 1 * MiB
#: Arrays from this size on are read from local storage by a pool of threads, several at once,
#: while the restore hands out the ones before them in order: two threads move (and fault in
#: the fresh memory of) a warm state 1.6x faster than one on 2 cores.
READ_AHEAD_MIN_BYTES = 1 * MiB
#: The threads of that pool (at most; fewer on fewer cores).
READ_AHEAD_THREADS = 4

# -- restore of many small arrays (engine/restore/read.py) -----------------------------------
#: The raw pieces of at most REGION_PIECE_BYTES of one data file are read in regions of at
#: most REGION_READ_BYTES, one read each, every piece then checked over its slice of the
#: region and copied out; a larger piece is read straight into its array (its own read costs
#: less than the copy).
REGION_PIECE_BYTES = 64 * 1024
REGION_READ_BYTES = 16 * MiB
#: Two pieces at most this far apart in a data file are read in one region (the bytes between
#: them, alignment padding, are read and dropped).
REGION_GAP_BYTES = 64 * 1024
#: The heads of at most this many manifests (a few hundred bytes each) are remembered in a
#: process, by the SHA-256 of their bytes, so that retention and resume do not decode them again.
STEP_INFO_CACHE_ENTRIES = 4096

# -- model-parallel state (engine/save/persist.py, engine/restore/reshard.py) -----------------
#: A rank's raw part of a sharded tensor (a DTensor's shard) larger than this is recorded as
#: pieces of this size, each with its checksum: a rank of another mesh that needs some of the
#: part reads (and verifies) only the pieces holding it, not the whole part.
SHARD_PIECE_BYTES = 8 * MiB

# -- preemption notices (preemption/) ----------------------------------------------------
#: The longest lead time a preemption notice may announce (a signal's ``@seconds``, a
#: notice's ``lead_s``): one day (SLURM's ``--signal`` allows at most 65535 s).
MAX_LEAD_S = 86_400.0
#: How often the cloud metadata pollers ask (AWS advises every 5 s; the notice gives 120 s).
METADATA_POLL_S = 5.0
#: How long one metadata request may take (the endpoint is on the machine itself).
METADATA_TIMEOUT_S = 1.0
#: The time a notice's save keeps in reserve for what follows it (closing, the exit).
PREEMPTION_MARGIN_S = 3.0
#: A save moved toward a known end keeps, beyond the margin, this share of its measured time
#: in reserve: a save that runs longer than the longest of the last few still fits. (Simulated
#: by benchmarks/preemption_bench.py, saves varying by a lognormal factor of sigma 0.1: without
#: it, about 1 in 100 moved saves of 20-100 GB did not finish before the deadline, each losing
#: the work since the previous checkpoint; with it, none.)
NOTICE_PLAN_RESERVE = 0.25
#: A save moved toward a known end is said again (a WARNING line) when made again only when it
#: comes this share of the steps still ahead sooner than the plan last said (or a new notice
#: is in force); smaller moves (the pace of the steps measured again) are logged at INFO.
NOTICE_PLAN_RESAY = 0.25
#: The grace period assumed after a SIGTERM (Kubernetes' and torchelastic's default).
SIGTERM_GRACE_S = 30.0
#: The exit status after a preemption (a process ended by SIGTERM reports 128 + 15).
PREEMPTED_EXIT_CODE = 143
