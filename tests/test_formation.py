"""Group formation's state table (averaging/formation.py), pure: every row, and every incident that
shaped the matchmaker a scenario (its commit named), in milliseconds, no network.

The real-network counterparts stay in tests/test_averaging.py (groups on loopback, a join that
arrives while the leader reads, a leader that died after declaring, no group in time).
"""

from __future__ import annotations

from libp2p.peer.id import ID
from multiaddr import Multiaddr

from averaging.formation import (Accept, Admit, AskToJoin, AwaitJoins, Declaring, Defer, Done, Fail, Fix, Formation,
                                 FormationRules, HandOver, Joined, Phase, Read, Redirect, Redirected, Refused, Reject,
                                 Sleep, Unreachable, answer_admitted, redeclare_after)
from averaging.group import Group, Member, Role

POLL = 0.5
RULES = FormationRules(target=3, min_size=2, gather_time=3.0, poll_interval=POLL)
DEADLINE = 30.0
RELAY = "/ip4/11.0.1.2/tcp/4001/p2p/12D3KooWFSzsWFHfEVcD7T9fEWyayVQpcmkjNKbNTyyRntvjGfju/p2p-circuit"


def peer_id(rank: int) -> ID:
    """Peer ids that sort by ``rank`` (the leader is the lowest among equals)."""
    return ID(bytes([0, 36, 8, 1, 18, 32]) + bytes([rank]) * 32)


def member(rank: int, role: Role = Role.FULL, *, leads: bool = True, schema: bytes = b"s", expiration: float = 100.0,
           relayed: bool = False) -> Member:
    addrs = (Multiaddr(RELAY),) if relayed else (Multiaddr(f"/ip4/11.0.0.{rank}/tcp/4001"),)
    return Member(peer_id(rank), addrs, role, schema, accepts_joins=leads, expiration=expiration)


def formation(me: Member, rules: FormationRules = RULES, **kw: object) -> Formation:
    return Formation(me, rules, DEADLINE, **kw)  # type: ignore[arg-type]


def group_of(*members: Member, me: Member) -> Group:
    ordered = tuple(sorted(members, key=lambda m: m.peer_id.to_bytes()))
    return Group(b"g" * 16, ordered, ordered.index(me))


A, B, C, D = (member(k) for k in (1, 2, 3, 4))


# ---------------------------------------------------------------------------- looking


def test_start_reads_the_declarations_and_past_the_deadline_fails() -> None:
    assert formation(B).start(0.0) == Read()
    f = formation(B)
    assert f.start(DEADLINE) == Fail() and f.phase is Phase.FAILED


def test_looking_with_no_leader_to_pick_sleeps_a_poll() -> None:
    me = member(2, leads=False)  # a client-mode peer never leads
    f = formation(me)
    assert f.on_declarations([me, member(1, leads=False)], 0.0) == Sleep(POLL)
    assert f.phase is Phase.LOOKING
    assert f.on_timer(1.0) == Read()
    assert f.on_timer(DEADLINE) == Fail() and f.phase is Phase.FAILED


def test_looking_picks_the_best_leader_and_follows_it() -> None:
    f = formation(B)
    assert f.on_declarations([B, C, A], 0.0) == AskToJoin(A)
    assert f.phase is Phase.FOLLOWING and f.following == A


def test_looking_leads_when_it_ranks_first() -> None:
    f = formation(A)
    assert f.on_declarations([B, A, C], 1.0) == AwaitJoins(POLL)
    assert f.phase is Phase.LEADING and f.leading_since == 1.0


def test_a_reducer_leads_before_a_sender_behind_a_nat_with_a_lower_id() -> None:
    """2fa6bdb: a symmetric-NAT sender also lists its LAN address and led whenever its id sorted
    first, every join crossing the relay."""
    sender, relayed = member(1, Role.SENDER), member(0, relayed=True)
    f = formation(C)
    assert f.on_declarations([sender, relayed, C, B], 0.0) == AskToJoin(B)


# ---------------------------------------------------------------------------- following


def test_following_joined_is_done() -> None:
    f = formation(B)
    f.on_declarations([A, B], 0.0)
    group = group_of(A, B, me=B)
    assert f.on_join_answered(Joined(group), 0.1) == Done(group) and f.phase is Phase.FIXED


def test_a_refusing_leader_is_skipped_for_two_polls_then_asked_again() -> None:
    """fc1d33e: refusals expire (a peer that was not leading a moment ago may lead now)."""
    f = formation(C)
    f.on_declarations([A, B, C], 0.0)
    assert f.on_join_answered(Refused("not leading"), 1.0) == Sleep(POLL / 2)
    assert f.phase is Phase.LOOKING
    assert f.on_declarations([A, B, C], 1.3) == AskToJoin(B)  # A skipped until 1.0 + 2 polls
    f.on_join_answered(Refused("group full"), 1.4)
    assert f.on_declarations([A, B, C], 2.0) == AskToJoin(A)  # A's refusal expired


def test_a_redirect_goes_to_the_new_leader_at_once_even_one_that_refused_us() -> None:
    f = formation(D)
    f.on_declarations([B, D], 0.0)  # B leads as far as we know
    f.on_join_answered(Refused("not leading"), 0.1)
    f.on_declarations([C, D], 0.6)  # then C
    assert f.on_join_answered(Redirected(B.peer_id), 0.7) == Read()  # C sends us to B
    assert f.on_declarations([B, C, D], 0.8) == AskToJoin(B)
    f.on_join_answered(Redirected(C.peer_id), DEADLINE + 1)
    assert f.phase is Phase.FAILED


def test_an_unreachable_leader_is_skipped_while_its_declaration_lives() -> None:
    """dbd4cab: a killed leader's declaration outlives it; retried every second, it drew its
    would-be followers (and leaders handing theirs over) back to it until the deadline: 7 peers
    without an average in 373 reliability rounds."""
    dead = member(1, expiration=40.0)
    unreachable: dict[ID, float] = {}
    f = formation(C, unreachable=unreachable)
    assert f.on_declarations([dead, B, C], 0.0) == AskToJoin(dead)
    assert f.on_join_answered(Unreachable("connection refused"), 0.1) == Sleep(POLL / 2)
    assert unreachable == {dead.peer_id: 40.0}
    assert f.on_declarations([dead, B, C], 5.0) == AskToJoin(B)  # long after a refusal would expire
    # a leader that sees it does not hand its followers over to it either
    lead = formation(B, unreachable=unreachable)
    lead.on_declarations([B, C], 0.0)
    assert lead.on_declarations([dead, B, C], 0.6) == AwaitJoins(POLL)
    # declared anew (it came back): asked again
    f.on_join_answered(Refused("x"), 5.1)
    assert f.on_declarations([member(1, expiration=80.0), B, C], 6.0) == AskToJoin(member(1, expiration=80.0))


# ---------------------------------------------------------------------------- leading


def leading(me: Member = A, rules: FormationRules = RULES, at: float = 0.0) -> Formation:
    f = formation(me, rules)
    f.on_declarations([me], at)
    assert f.phase is Phase.LEADING
    return f


def test_a_full_group_is_fixed_at_once_sorted_by_peer_id() -> None:
    f = leading()
    assert f.on_join(C) == Admit() and f.on_join(B) == Admit()
    assert f.on_woken(0.1) == Fix((A, B, C))
    done = f.fixed(group_of(A, B, C, me=A))
    assert isinstance(done, Done) and f.phase is Phase.FIXED


def test_a_full_group_takes_the_one_peer_it_would_leave_alone() -> None:
    """A cell of target + 1 (bench/scale.py, 1,000 peers, m = 10: every peer left without a group
    was the eleventh of such a cell): the leader that read them all takes one more rather than leave
    one peer, too few for a group, to fail alone; with target + min_size it keeps to the target."""
    E = member(5)
    f = formation(A)
    assert f.on_declarations([A, B, C, D], 0.0) == AwaitJoins(POLL)  # 4 declared, target 3, min 2
    assert f.capacity() == 4
    assert f.on_join(C) == Admit() and f.on_join(B) == Admit()
    assert f.on_woken(0.1) == Read()  # 3 of 4: not full yet
    assert f.on_declarations([A, B, C, D], 0.2) == AwaitJoins(POLL)
    assert f.on_join(D) == Admit()
    assert f.on_woken(0.3) == Fix((A, B, C, D))
    g = formation(A)
    g.on_declarations([A, B, C, D, E], 0.0)  # 5 = 3 + 2: the two left form a group of their own
    assert g.capacity() == 3
    assert g.on_join(B) == Admit() and g.on_join(C) == Admit() and g.on_join(D) == Reject("group full")
    assert g.on_woken(0.1) == Fix((A, B, C))
    late = formation(A)
    late.on_declarations([A, B, C, D], 0.0)
    late.on_join(B)
    assert late.on_tick(3.0) == Fix((A, B))  # who declared and never came delays the group by gather_time at most
    unread = formation(A)
    unread.on_declarations([A, B, C], 0.0)  # D's declaration had not reached the replicas read
    assert unread.on_join(B) == Admit() and unread.on_join(D) == Admit()
    assert unread.on_woken(0.1) == Read()
    assert unread.on_declarations([A, B, C], 0.2) == AwaitJoins(POLL)  # still not there: D is a follower
    assert unread.on_join(C) == Admit()
    assert unread.capacity() == 4 and unread.on_woken(0.3) == Fix((A, B, C, D))
    told = formation(A, FormationRules(target=3, min_size=2, gather_time=3.0, poll_interval=POLL,
                                       absorb_remainder=False))  # the caller said 3 come: fixed at once
    told.on_declarations([A, B, C, D], 0.0)
    assert told.capacity() == 3 and told.on_join(B) == Admit() and told.on_join(C) == Admit()
    assert told.on_woken(0.1) == Fix((A, B, C))


def test_a_full_group_takes_the_senders_no_other_group_could_take() -> None:
    """A cell of 12 or 13 with m = 10 (bench/scale.py, 1,000 peers: most of the peers still left
    without a group): the leader filled its group of ten, and the two or three senders behind
    NATs left over, none of whom can lead or reduce, failed at the deadline. The leader that read
    them takes them all, and waits for them a gather_time after its group was full."""
    E, F = member(5, Role.SENDER, leads=False), member(6, Role.SENDER, leads=False)
    f = formation(A)
    f.on_declarations([A, B, C, E, F], 0.0)  # target 3: B and C may lead and reduce elsewhere
    assert f.capacity() == 3
    assert f.on_join(B) == Admit() and f.on_join(C) == Admit()  # full: E and F are left, only senders
    assert f.capacity() == 5
    assert f.on_woken(4.0) == Read()  # gather_time passed since we led, but not since the group was full
    assert f.on_declarations([A, B, C, E, F], 4.1) == AwaitJoins(POLL)
    assert f.on_join(E) == Admit() and f.on_join(F) == Admit()
    assert f.on_woken(4.3) == Fix((A, B, C, E, F))
    late = formation(A)
    late.on_declarations([A, B, C, E, F], 0.0)
    late.on_join(B)
    assert late.on_woken(1.0) == Read()  # two of three: not full yet
    late.on_join(C)
    assert late.on_woken(4.0) == Read()  # full since 4.0, not 1.0
    assert late.on_declarations([A, B, C, E, F], 6.9) == AwaitJoins(POLL)
    assert late.on_tick(7.0) == Fix((A, B, C))  # they never came: a gather_time longer at most
    others = formation(A)
    others.on_declarations([A, B, C, D, E, F], 0.0)  # D can lead E and F: a group of their own
    others.on_join(B)
    others.on_join(C)
    assert others.capacity() == 3 and others.on_woken(4.0) == Fix((A, B, C))
    lone = formation(A)
    lone.on_declarations([A, B, C, member(7, Role.SENDER), E], 0.0)  # a sender that may lead, no reducer
    lone.on_join(B)
    lone.on_join(C)
    assert lone.capacity() == 5
    told = formation(A, FormationRules(target=3, min_size=2, gather_time=3.0, poll_interval=POLL,
                                       absorb_remainder=False))  # the caller said 3 come
    told.on_declarations([A, B, C, E, F], 0.0)
    told.on_join(B)
    told.on_join(C)
    assert told.capacity() == 3 and told.on_woken(0.1) == Fix((A, B, C))


def test_min_size_is_fixed_once_gather_time_passed() -> None:
    f = leading(at=10.0)
    f.on_join(B)
    assert f.on_woken(10.5) == Read()  # not full: is there a better leader?
    assert f.on_declarations([A, B], 10.6) == AwaitJoins(POLL)  # we still lead, gathering
    assert f.on_tick(12.9) == AwaitJoins(POLL)
    assert f.on_tick(13.0) == Fix((A, B))


def test_a_follower_whose_join_call_ended_is_not_fixed_into_the_group() -> None:
    """Its call was cancelled, or its connection dropped, while we held it: a group fixed with it
    would wait for its part and end partial. Once it joins again, it is a follower again."""
    f = leading(at=10.0)
    b_first, b_again = member(2), member(2, expiration=101.0)
    f.on_join(b_first)
    f.on_join(C)
    f.on_follower_gone(b_first)
    assert f.on_tick(13.0) == Fix((A, C))
    g = leading(at=10.0)
    g.on_join(b_first)
    g.on_join(b_again)  # it came back before the first call's end was seen
    g.on_follower_gone(b_first)
    assert g.on_tick(13.0) == Fix((A, b_again))


def test_the_last_wait_ends_at_the_deadline() -> None:
    f = leading(at=DEADLINE - 0.25)
    assert f.on_tick(DEADLINE - 0.25) == AwaitJoins(0.25)  # not a whole poll past it


def test_a_group_waits_for_a_member_that_may_reduce() -> None:
    """fc1d33e: a group needs a reducer; a leader of senders waits for one, and at the deadline
    without one there is no group."""
    me = member(1, Role.SENDER)
    f = leading(me)
    f.on_join(member(2, Role.SENDER))
    f.on_join(member(3, Role.SENDER))
    assert isinstance(f.on_tick(10.0), AwaitJoins)  # full, but nobody may reduce
    assert f.on_tick(DEADLINE) == Fail()
    g = leading(me)
    g.on_join(member(2, Role.AUXILIARY))
    assert g.on_tick(DEADLINE) == Fix((me, member(2, Role.AUXILIARY)))  # the deadline fixes what is possible


def test_a_leader_of_senders_at_capacity_reads_on_and_hands_over_to_a_reducer() -> None:
    """The auxiliary test under load (delayed updates): two trainers that may not reduce, expecting
    a group of two, filled it and waited for the deadline without reading again, while the
    auxiliary peer declared a moment later led alone beside them. Full without a reducer, the
    leader reads on; the reducer it finds leads."""
    me = member(2, Role.SENDER)
    f = formation(me, FormationRules(target=2, min_size=2, gather_time=3.0, poll_interval=POLL))
    assert f.on_declarations([me, member(3, Role.SENDER)], 0.0) == AwaitJoins(POLL)
    f.on_join(member(3, Role.SENDER))
    assert f.on_woken(0.5) == Read()  # full, but nobody may reduce: is there someone now?
    helper = member(4, Role.AUXILIARY)
    assert f.on_declarations([me, member(3, Role.SENDER), helper], 0.6) == HandOver(helper.peer_id)
    assert answer_admitted(member(3, Role.SENDER), None, helper.peer_id) == Redirect(helper.peer_id)
    # full with a reducer: fixed at once, no read
    g = formation(me, FormationRules(target=2, min_size=2, gather_time=3.0, poll_interval=POLL))
    g.on_declarations([me], 0.0)
    g.on_join(helper)
    assert g.on_woken(0.5) == Fix((me, helper))


def test_at_the_deadline_alone_is_no_group() -> None:
    f = leading()
    assert f.on_tick(DEADLINE) == Fail() and f.phase is Phase.FAILED


def test_a_leader_that_sees_a_better_one_hands_its_followers_over_and_follows_them() -> None:
    """fc1d33e: views that differ for a moment still form one group (REDIRECT); eef42a4: a leader
    that handed its followers over follows them there at once, though that leader turned it away
    a moment before (it led alone and waited out the deadline: 1 peer without an average in 161
    reliability rounds)."""
    f = formation(B)
    f.on_declarations([A, B], 0.0)
    f.on_join_answered(Refused("not leading"), 0.1)  # A was not leading yet
    assert f.on_declarations([B], 0.3) == AwaitJoins(POLL)  # A's declaration not seen: we lead
    f.on_join(C)
    assert f.on_woken(0.8) == Read()
    assert f.on_declarations([A, B, C], 0.9) == HandOver(A.peer_id)
    assert f.phase is Phase.LOOKING and f.redirect == A.peer_id
    assert answer_admitted(C, None, A.peer_id) == Redirect(A.peer_id)  # C goes to A
    assert f.on_timer(0.9) == Read()
    assert f.on_declarations([A, B, C], 1.0) == AskToJoin(A)  # and so do we, refused or not


# ---------------------------------------------------------------------------- joins asked of us


def test_a_join_while_we_read_the_declarations_is_answered_once_we_know() -> None:
    """76867ec: a peer asked to lead while it reads the declarations answered 'not leading'; the
    joiner skipped it and was left out of the group formed a moment later (20 s lone waits in 1 of
    3 reliability rounds). It defers, then answers as it then is."""
    f = formation(A)
    assert f.on_join(B) == Defer()
    f.on_declarations([A, B], 0.0)  # we lead
    assert f.on_join(B, asked_again=True) == Admit()
    g = formation(C)
    assert g.on_join(D) == Defer()
    assert g.on_join(D, asked_again=True) == Reject("not leading")  # still looking after a poll


def test_joins_asked_of_us_in_each_phase() -> None:
    f = formation(B)
    assert f.on_join(member(3, schema=b"other")) == Reject("not matching now")
    f.on_declarations([A, B], 0.0)
    assert f.on_join(C) == Redirect(A.peer_id)  # following A
    lead = leading(rules=FormationRules(target=2, min_size=2, gather_time=3.0, poll_interval=POLL))
    assert lead.on_join(B) == Admit()
    assert lead.on_join(C) == Admit()  # asking, it is declared: one more than the target, not left alone
    # four: D alone could form no group (B and C are ours), so it is taken too; before, the count
    # of four said "two groups of two", D was turned away and C, admitted, was cut from the group
    assert lead.on_join(D) == Admit()
    assert lead.on_tick(0.1) == Fix((A, B, C, D))
    lead.fixed(group_of(A, B, C, D, me=A))
    assert lead.on_join(member(5)) == Reject("group full")
    failed = leading()
    failed.on_tick(DEADLINE)
    assert failed.on_join(B) == Reject("not matching now")


def test_admitted_followers_hear_the_group_or_where_to_go() -> None:
    group = group_of(A, B, me=A)
    assert answer_admitted(B, group, None) == Accept(group)
    assert answer_admitted(C, group, None) == Reject("the group formed without you")  # over the target
    assert answer_admitted(C, None, D.peer_id) == Redirect(D.peer_id)
    assert answer_admitted(C, None, None) == Reject("the group formed without you")


def test_the_failure_says_why() -> None:
    """a862a12: matchmaking says so when nobody seen may reduce; a peer that cannot lead, alone,
    says that."""
    f = formation(member(2, Role.SENDER))
    f.on_declarations([member(2, Role.SENDER), member(1, Role.SENDER)], 0.0)
    assert "none of them may reduce" in f.failure("run.matchmaking", 30)
    lone = formation(member(2, leads=False))
    lone.on_declarations([member(2, leads=False)], 0.0)
    assert "this peer cannot lead and no other can" in lone.failure("run.matchmaking", 30)


def test_the_failure_says_exactly_why_in_each_case() -> None:
    prefix = "no group of at least 2 formed under 'run.matchmaking' within 30 s"
    # nobody declared, a peer that leads: nothing to add
    empty = formation(member(2))
    assert empty.failure("run.matchmaking", 30) == f"{prefix} (0 matching peers declared)"
    # only senders seen, and a peer that cannot lead with nobody else: both reasons, in full
    alone = formation(member(2, Role.SENDER, leads=False))
    alone.on_declarations([member(2, Role.SENDER, leads=False)], 0.0)
    assert alone.failure("run.matchmaking", 30) == (
        f"{prefix} (1 matching peers declared; this peer cannot lead and no other can; none of them may reduce "
        "a part (all senders: client mode, relayed, or reduces=False))")
    # two seen: another could lead; a reducer seen once stays seen though later reads show none
    two = formation(member(2, leads=False))
    two.on_declarations([member(2, leads=False), member(1, Role.SENDER)], 0.0)
    two.on_declarations([member(2, Role.SENDER, leads=False), member(1, Role.SENDER)], 1.0)
    assert two.reducers_seen is True
    assert two.failure("run.matchmaking", 30) == f"{prefix} (2 matching peers declared)"
    # a leader that sees only senders but itself reduces: no reducer complaint
    leads = formation(member(2))
    leads.on_declarations([member(2), member(1, Role.SENDER)], 0.0)
    assert leads.failure("run.matchmaking", 30) == f"{prefix} (2 matching peers declared)"


def test_a_declaration_is_stored_again_at_the_next_poll_until_a_replica_took_it_then_every_five_seconds() -> None:
    assert redeclare_after(False, POLL) == 1.0  # no faster than once a second, at a short poll
    assert redeclare_after(False, 2.0) == 2.0  # the next poll
    assert [redeclare_after(False, POLL, n) for n in (1, 2, 3, 4, 5)] == [1.0, 2.0, 4.0, 5.0, 5.0]  # backing off
    assert redeclare_after(True, POLL) == redeclare_after(True, 2.0) == redeclare_after(True, POLL, 3) == 5.0


def test_the_stores_of_a_declaration_are_counted_alike_by_both_shells() -> None:
    lost, took = Declaring().then(False), Declaring().then(True)
    assert (lost, took) == (Declaring(False, 1), Declaring(True, 0))
    assert lost.then(False).then(False) == Declaring(False, 3) and lost.then(False).wait(POLL) == 2.0
    assert lost.then(True).then(False) == Declaring(True, 1) and took.then(False).wait(POLL) == 5.0  # taken once
