"""What entries saved by another configuration or llama-server are good for here, found once at start.

Why apart: a llama-server upgrade changes the state format, another -np or KV type what the loader takes. The
store learns the format this llama-server writes (a probe: an empty slot saved), sets aside what it cannot
read, and loads one file of each group of other configurations to let llama-server's answer decide
(store/fit.py judges the rest: loaded, recomputed from its tokens, or kept).
"""

from __future__ import annotations

import asyncio

from ..log import log
from .entries import (
    Entry,
    compatible_format,
    discard,
    file_checksum,
    pair_paths,
)
from .fit import UNFIT_WORDS, Fit, fit, group_of, same_tensors
from .outcomes import RestoreResult
from .restores import Restores
from .slotfiles import transient_path
from .staging import Staged
from .statefile import StateFileError, read_header


class FitChecks(Restores):
    """What the entries of other configurations are good for here (restored into a probe slot to find out)."""

    async def check_format(self) -> None:
        """When some entry was written by another llama-server than this one, learn the state format this one
        writes (a save of slot 0, empty at start) and set aside the entries it cannot read."""
        if not self.needs_format_probe():
            return
        self.current_format = await self.probe_format(0)
        if self.current_format is not None:
            self.check_formats()

    def needs_format_probe(self) -> bool:
        """True when some entry was written by another llama-server than this one (its format may differ)."""
        return any(e.server != self.server for e in self.entries.values())

    def check_formats(self) -> None:
        """Set aside entries this llama-server cannot read, instead of trying and quarantining them (what is
        done with them is check_fit's, and its line)."""
        current = self.current_format
        if current is None:
            return
        unreadable = [e for e in self.entries.values() if not compatible_format(e, current)]
        for entry in unreadable:
            self.unindex(entry)
            self._keep_unused(
                entry,
                f"format v{entry.seq_version} ({entry.layout}); this llama-server writes v{current[0]} ({current[1]})",
            )

    async def check_fit(self, probe_slot: int = 0) -> None:
        """At start, once the format is known: what each entry set aside for another configuration is good for
        here (fit.py). One file of each group computed by these tensors is loaded into `probe_slot` (then
        erased): llama-server's answer, not the flags, says whether its group loads. The entries that load join
        the index; those whose tokens this model can recompute wait for it (`recomputable`); one line each."""
        running = self.running
        kept = sorted(self._kept.values(), key=lambda e: e.last_used, reverse=True)
        if not kept:
            self.say_kept()
            return
        groups: dict[str, list[Entry]] = {}
        for entry in kept:
            if same_tensors(entry.fingerprint, running.fingerprint) and not entry.images:
                groups.setdefault(group_of(entry), []).append(entry)
        loads: dict[str, bool] = {}
        for name, members in groups.items():
            loads[name] = await self._group_loads(members, probe_slot)
        loaded = 0
        for entry in kept:
            verdict = fit(entry, running, loads=loads.get(group_of(entry)))
            if verdict.fit is Fit.LOADS:
                self._unkeep(entry)
                self.index(entry)
                loaded += 1
            elif verdict.fit is Fit.RECOMPUTE:
                self.recomputable[entry.id] = entry
            elif verdict.unfit is not None:
                self.unfit[entry.id] = verdict.unfit
                self.skipped[entry.id] = f"{self.skipped[entry.id]}; not recomputed: {UNFIT_WORDS[verdict.unfit]}"
        if loaded:
            log.info(
                "%d entr%s saved by another configuration used as saved: this llama-server loads %s",
                loaded,
                "y" if loaded == 1 else "ies",
                "it" if loaded == 1 else "them",
            )
        self.say_kept()

    async def _group_loads(self, members: list[Entry], slot_id: int) -> bool:
        """Whether the running llama-server loads a file of this group: its smallest whose checksum holds is
        loaded into the slot, which is then erased. A file refused is never quarantined: it is another
        configuration's, and that configuration loads it."""
        assert self.client is not None
        for entry in sorted(members, key=lambda e: e.nbytes):
            try:
                staged = await self._checked_file(entry)
                if staged is None:
                    continue
            except OSError as exc:
                log.debug("entry %s not tried (%s)", entry.short, exc)
                return False
            try:
                reply = await self.client.slot_action(slot_id, "restore", staged.name.name)
                if reply.ok:
                    await self.client.slot_action(slot_id, "erase")
                return reply.ok
            except (OSError, ConnectionError) as exc:
                log.debug("entry %s not tried (%s)", entry.short, exc)
                return False
            finally:
                staged.remove()
        return False

    async def _checked_file(self, entry: Entry) -> Staged | None:
        """An entry's file under a transient name, its checksum checked first: put together from its blocks, or
        its own file through a link. None when it is not to be tried (its bytes changed on disk: quarantined;
        unreadable); OSError when the link cannot be made."""
        if entry.parts is not None:
            staged = await self._assembled(entry)
            return None if isinstance(staged, RestoreResult) else staged  # (said in one line, or quarantined)
        source = pair_paths(self.entries_dir, entry.id)[0]
        try:
            if entry.checksum and await asyncio.to_thread(file_checksum, source) != entry.checksum:
                self._unkeep(entry)
                self._quarantine(entry, "its file changed on disk: the content checksum does not match")
                return None
        except OSError:
            return None
        link = transient_path(self.snapshots_dir)
        try:
            await self._expose(source, link)
        except BaseException:
            discard(link)
            raise
        return Staged(link, link)

    def recomputed(self, old: Entry, new: Entry) -> None:
        """`old` (another configuration's) was recomputed as `new`: it stays kept (a downgrade uses it) until the
        cap removes it, and is not recomputed again."""
        self.recomputable.pop(old.id, None)
        self.skipped[old.id] = f"recomputed as entry {new.short}"

    async def probe_format(self, slot_id: int) -> tuple[int, str] | None:
        """Save an (empty) slot to learn the state format this llama-server writes; None if it cannot say."""
        assert self.client is not None
        transient = transient_path(self.snapshots_dir)
        try:
            reply = await self.client.slot_action(slot_id, "save", transient.name)
            if not reply.ok:
                return None
            header = await asyncio.to_thread(read_header, transient)
            return header.version, header.layout
        except (OSError, StateFileError, ConnectionError):
            return None
        finally:
            transient.unlink(missing_ok=True)
