#!/usr/bin/env python3
"""Writes tests/assets/text/english.txt: the English training text of the tests.

The training tests (golden losses, layout equivalence, the command line) need
a few hundred kilobytes of real-looking English that ships with the
repository. This script composes it from its own word lists and sentence
patterns with a fixed pseudo-random sequence (splitmix64, so the output does
not depend on the Python version): short paragraphs of narration, dialogue,
questions, instructions, notes and sayings, one document each, separated by
lines holding only '%' (the document separator of `xirang data prepare`).

The output is checked in; rerun only to change the text, and regenerate the
golden losses after (tests/runtime/trainer_test.cc, XIRANG_UPDATE_GOLDEN=1).

    python3 tests/assets/text/make_english.py > tests/assets/text/english.txt
"""
import sys
import textwrap

MASK = (1 << 64) - 1


class Rng:
    """splitmix64: a tiny generator whose sequence is fixed forever."""

    def __init__(self, seed):
        self.state = seed & MASK

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    def below(self, n):
        return self.next() % n

    def pick(self, items):
        return items[self.below(len(items))]

    def chance(self, percent):
        return self.below(100) < percent


NAMES = """Ada Bram Celia Dorian Edith Felix Greta Hugo Ines Jonah Kira Leon Mabel Nico Olive
Percy Quinn Rosa Silas Tamsin Ulric Vera Wendell Xenia Yusuf Zelda Agnes Barnaby Clement Delphine
Ezra Flora Gideon Hester Ivo Juno Kasper Lydia Magnus Nora Otto Pia Rufus Sabine Tobias""".split()

# (singular, plural)
NOUNS = [tuple(p.split("/")) for p in """
lantern/lanterns kettle/kettles harbour/harbours ferry/ferries bridge/bridges orchard/orchards
window/windows ladder/ladders letter/letters compass/compasses meadow/meadows river/rivers
chimney/chimneys garden/gardens library/libraries market/markets basket/baskets candle/candles
hammer/hammers saddle/saddles lighthouse/lighthouses cottage/cottages wagon/wagons sparrow/sparrows
heron/herons fox/foxes badger/badgers beetle/beetles violin/violins drum/drums engine/engines
clock/clocks map/maps notebook/notebooks pencil/pencils blanket/blankets loaf/loaves cheese/cheeses
apple/apples pear/pears turnip/turnips onion/onions barrel/barrels bucket/buckets well/wells
mill/mills tower/towers gate/gates fence/fences hedge/hedges path/paths road/roads valley/valleys
hill/hills island/islands cliff/cliffs storm/storms cloud/clouds season/seasons morning/mornings
evening/evenings winter/winters summer/summers kitchen/kitchens workshop/workshops tailor/tailors
baker/bakers sailor/sailors farmer/farmers teacher/teachers doctor/doctors carpenter/carpenters
weaver/weavers fisherman/fishermen child/children neighbour/neighbours stranger/strangers
traveller/travellers captain/captains clerk/clerks musician/musicians painter/painters
shepherd/shepherds goose/geese sheep/sheep horse/horses dog/dogs cat/cats owl/owls boat/boats
sail/sails rope/ropes anchor/anchors net/nets shell/shells stone/stones pebble/pebbles feather/feathers
key/keys door/doors box/boxes jar/jars spoon/spoons cup/cups plate/plates table/tables chair/chairs
shelf/shelves book/books story/stories song/songs question/questions answer/answers promise/promises
rumour/rumours secret/secrets habit/habits recipe/recipes machine/machines wheel/wheels gear/gears
spring/springs bell/bells whistle/whistles coat/coats boot/boots scarf/scarves umbrella/umbrellas
station/stations train/trains ticket/tickets parcel/parcels envelope/envelopes stamp/stamps
telescope/telescopes star/stars planet/planets comet/comets moon/moons tide/tides wave/waves
""".split()]

ADJECTIVES = """old young quiet noisy patient restless careful clumsy bright dim narrow wide
crooked straight heavy light warm cold damp dry golden silver copper wooden woollen
tall short ancient modern curious cheerful gloomy stubborn gentle brave timid honest
clever foolish tidy untidy humble proud faded painted rusty polished hollow solid
early late distant nearby small enormous fragile sturdy sleepy lively sour sweet
green blue grey crimson pale dusty muddy salty windy sunny""".split()

ADVERBS = """slowly quickly carefully quietly loudly gladly sadly gently firmly patiently
eagerly calmly suddenly finally nearly barely rarely often seldom always cheerfully
stubbornly wisely foolishly neatly awkwardly silently proudly humbly briskly lazily""".split()

# (present third person, past, present participle, base)
VERBS = [tuple(v.split("/")) for v in """
carries/carried/carrying/carry mends/mended/mending/mend paints/painted/painting/paint
counts/counted/counting/count opens/opened/opening/open closes/closed/closing/close
finds/found/finding/find loses/lost/losing/lose builds/built/building/build sells/sold/selling/sell
buys/bought/buying/buy borrows/borrowed/borrowing/borrow lends/lent/lending/lend
watches/watched/watching/watch follows/followed/following/follow polishes/polished/polishing/polish
measures/measured/measuring/measure weighs/weighed/weighing/weigh hides/hid/hiding/hide
remembers/remembered/remembering/remember forgets/forgot/forgetting/forget
cleans/cleaned/cleaning/clean fills/filled/filling/fill empties/emptied/emptying/empty
wraps/wrapped/wrapping/wrap ties/tied/tying/tie drags/dragged/dragging/drag lifts/lifted/lifting/lift
studies/studied/studying/study draws/drew/drawing/draw writes/wrote/writing/write reads/read/reading/read
guards/guarded/guarding/guard praises/praised/praising/praise repairs/repaired/repairing/repair
tests/tested/testing/test sorts/sorted/sorting/sort brings/brought/bringing/bring
""".split()]

# (present third person, past, base): verbs without an object
INTRANSITIVE = [tuple(v.split("/")) for v in """
waits/waited/wait sings/sang/sing sleeps/slept/sleep wanders/wandered/wander rests/rested/rest
laughs/laughed/laugh listens/listened/listen hesitates/hesitated/hesitate works/worked/work
travels/travelled/travel returns/returned/return vanishes/vanished/vanish arrives/arrived/arrive
shivers/shivered/shiver whistles/whistled/whistle grumbles/grumbled/grumble rises/rose/rise
falls/fell/fall drifts/drifted/drift shines/shone/shine rattles/rattled/rattle
""".split()]

PREPOSITIONS = """across along behind beside beyond under over near toward into through
past around against inside outside""".split()

PLACES = """the harbour wall|the old mill|the village square|the top of the hill|the edge of the
forest|the railway station|the bakery on Elm Street|the lighthouse steps|the north field|the
river bank|the market hall|the schoolhouse|the quiet end of the pier|the back of the
library|the crossroads|the orchard gate|the foot of the tower|the ferry landing|the
carpenter's yard|the upper meadow""".replace("\n", " ").split("|")

TIMES = """at dawn|before breakfast|after the rain|late in the evening|on Sunday
afternoon|in the middle of the night|when the tide was low|just before noon|during the
long winter|on the first warm day of spring|while the kettle boiled|as the bells
rang|at the end of the harvest|on market day|before the storm broke|after supper""".replace(
    "\n", " ").split("|")

MONTHS = """January February March April May June July August September October November
December""".split()

DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()

FEELINGS = """pleased surprised worried amused puzzled delighted tired relieved
embarrassed grateful doubtful hopeful""".split()

CONNECTIVES = """Later that day|Meanwhile|After a while|All the same|For a long time|By
then|Even so|In the end|Soon afterwards|At first|Every so often|Not long after""".replace(
    "\n", " ").split("|")

SAYINGS_HEAD = """A patient|An honest|A careful|A hungry|A tired|A curious|A wise|A stubborn|A
cheerful|A quiet""".replace("\n", " ").split("|")

NUMBER_WORDS = """two three four five six seven eight nine ten eleven twelve twenty""".split()


def a_or_an(word):
    return "an" if word[0] in "aeiou" or word.startswith("honest") else "a"


class Writer:
    def __init__(self, seed):
        self.r = Rng(seed)

    # ---- phrases

    def noun(self, plural=False):
        n = self.r.pick(NOUNS)
        return n[1] if plural else n[0]

    def noun_phrase(self, the=True, plural=False):
        n = self.noun(plural)
        if self.r.chance(55):
            n = self.r.pick(ADJECTIVES) + " " + n
        if plural:
            return ("the " + n) if the else self.r.pick(["some", "a few", "several", "many"]) + " " + n
        return ("the " + n) if the else a_or_an(n) + " " + n

    def subject(self):
        k = self.r.below(10)
        if k < 4:
            return self.r.pick(NAMES), False
        if k < 6:
            return self.noun_phrase(the=True, plural=True), True
        return self.noun_phrase(the=True), False

    def place(self):
        return self.r.pick(PLACES)

    def time(self):
        k = self.r.below(4)
        if k == 0:
            return "on the %d%s of %s" % self.date()
        if k == 1:
            return "on %s" % self.r.pick(DAYS)
        return self.r.pick(TIMES)

    def date(self):
        d = 1 + self.r.below(28)
        suffix = "th" if 10 <= d % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(d % 10, "th")
        return d, suffix, self.r.pick(MONTHS)

    # ---- sentences

    def narration(self):
        s, plural = self.subject()
        v = self.r.pick(VERBS)
        out = "%s %s %s" % (s, v[1], self.noun_phrase(the=self.r.chance(60), plural=self.r.chance(25)))
        k = self.r.below(6)
        if k == 0:
            out += " %s %s" % (self.r.pick(PREPOSITIONS), self.place())
        elif k == 1:
            out += " " + self.time()
        elif k == 2:
            out += " " + self.r.pick(ADVERBS)
        elif k == 3:
            i = self.r.pick(INTRANSITIVE)
            out += ", and %s %s" % (self.noun_phrase(), i[1])
        elif k == 4:
            out += " because %s had %s" % (self.r.pick(["nobody else", "someone", "the whole village",
                                                      "the old clerk", "the wind"]),
                                            self.r.pick(["asked", "forgotten", "insisted", "promised", "refused"]))
        return out[0].upper() + out[1:] + "."

    def scene(self):
        i = self.r.pick(INTRANSITIVE)
        s, _ = self.subject()
        t = self.time()
        out = "%s, %s %s %s %s" % (t, s, i[1], self.r.pick(PREPOSITIONS), self.place())
        if self.r.chance(40):
            out += " and felt %s" % self.r.pick(FEELINGS)
        return out[0].upper() + out[1:] + "."

    def connected(self):
        c = self.r.pick(CONNECTIVES)
        s = self.narration()
        return "%s, %s" % (c, s[0].lower() + s[1:] if not s.split()[0] in NAMES else s)

    def dialogue(self):
        speaker = self.r.pick(NAMES)
        k = self.r.below(5)
        if k == 0:
            q = "Have you seen %s?" % self.noun_phrase()
        elif k == 1:
            q = "We should %s %s before %s." % (self.r.pick(VERBS)[3], self.noun_phrase(),
                                                self.r.pick(["dark", "the rain", "supper", "the ferry leaves",
                                                             "anyone notices", "winter"]))
        elif k == 2:
            q = "I never liked %s, but I liked %s even less." % (self.noun_phrase(plural=True),
                                                                 self.noun_phrase(plural=True))
        elif k == 3:
            q = "There are %s %s %s %s, and not one of them is %s." % (
                self.r.pick(NUMBER_WORDS), self.noun(True), self.r.pick(PREPOSITIONS), self.place(),
                self.r.pick(ADJECTIVES))
        else:
            q = "Don't %s %s; it belongs to %s." % (self.r.pick(VERBS)[3], self.noun_phrase(),
                                                  self.r.pick(NAMES))
        if q.endswith("?"):
            verb = self.r.pick(["asked", "whispered", "called", "wondered"])
        else:
            verb = self.r.pick(["said", "whispered", "called", "muttered", "replied", "announced"])
        if q.endswith("."):
            q = q[:-1] + ","
        return '"%s" %s %s.' % (q, verb, speaker)

    def question(self):
        k = self.r.below(4)
        if k == 0:
            v = self.r.pick(VERBS)
            return "Why would anyone %s %s %s %s?" % (v[3], self.noun_phrase(), self.r.pick(PREPOSITIONS),
                                                     self.place())
        if k == 1:
            return "Who left %s %s %s?" % (self.noun_phrase(the=False), self.r.pick(PREPOSITIONS), self.place())
        if k == 2:
            i = self.r.pick(INTRANSITIVE)
            return "Does %s ever %s %s?" % (self.noun_phrase(), i[2], self.time())
        return "How many %s can %s %s in one day?" % (self.noun(True), self.r.pick(NAMES),
                                                      self.r.pick(VERBS)[3])

    def instruction(self):
        steps = []
        for n in range(2 + self.r.below(3)):
            v = self.r.pick(VERBS)
            step = "%s %s" % (v[3], self.noun_phrase())
            if self.r.chance(40):
                step += " " + self.r.pick(ADVERBS)
            steps.append(step)
        words = ["First", "then", "then", "and finally"]
        parts = [words[0] + ", " + steps[0]]
        for i, s in enumerate(steps[1:-1], 1):
            parts.append(words[i] + " " + s)
        parts.append("and finally " + steps[-1] if len(steps) > 1 else "")
        return "; ".join(p for p in parts if p) + "."

    def note(self):
        d, suffix, month = self.date()
        n = 2 + self.r.below(90)
        return "Note for the %d%s of %s: %d %s %s, %s %s." % (
            d, suffix, month, n, self.r.pick(ADJECTIVES), self.noun(True),
            self.r.pick(["counted twice", "still missing", "sent to the mill", "kept in the shed",
                         "returned to the captain", "sold at the market"]),
            self.r.pick(["as agreed", "(or so we think)", "before noon", "without complaint",
                         "to nobody's surprise"]))

    def saying(self):
        head = self.r.pick(SAYINGS_HEAD)
        n = self.noun()
        v = self.r.pick(VERBS)
        return "%s %s never %s %s twice." % (head, n, v[3], self.noun_phrase(the=False))

    def paragraph(self):
        kinds = [self.narration, self.narration, self.scene, self.connected, self.dialogue, self.dialogue,
                 self.question, self.narration, self.scene]
        k = self.r.below(20)
        if k == 0:
            return self.instruction() + " " + self.narration()
        if k == 1:
            return "\n".join(self.note() for _ in range(2 + self.r.below(4)))
        if k == 2:
            return self.saying()
        sentences = [self.r.pick(kinds)() for _ in range(3 + self.r.below(6))]
        return " ".join(sentences)


def main():
    w = Writer(20260101)
    out = []
    size = 0
    while size < 260_000:
        p = w.paragraph()
        lines = []
        for part in p.split("\n"):
            lines.extend(textwrap.wrap(part, width=72))
        text = "\n".join(lines)
        out.append(text)
        size += len(text) + 3
    sys.stdout.write("\n%\n".join(out) + "\n")


if __name__ == "__main__":
    main()
