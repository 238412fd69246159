"""The fixed text a quantization's quality report is measured on (quality.py). Written for localllm, so it
appears in no model's training data verbatim; it mixes prose, dialogue, instructions, lists, numbers and code, the
kinds of text local models are asked to continue. Changing it changes every report: bump TEXT_ID when you do."""

TEXT_ID = "localllm-builtin-v1"

TEXT = """\
The lighthouse on Marrow Point had been automated for eleven years when Ada Okafor took the job of looking after it.
The job, as the harbour office described it, was simple: walk the stairs once a week, wipe the salt from the lens,
write down the readings from the three gauges in the lamp room, and call the office if anything looked wrong. Nobody
had told her what wrong would look like. On her first morning she counted the stairs (one hundred and twelve), noted
that the brass rail was loose between the fortieth and forty-fifth steps, and found a notebook in the lamp room that
the previous keeper had left on the shelf beside the fuse box.

The notebook began in a careful hand. "Tuesday. Wind from the south-west, force five. Barometer 1012 and falling.
Lamp rotation nominal, 7.5 seconds per turn. Replaced the left wiper blade on the gallery window." The entries went on
like that for years, the handwriting slowly growing looser, until the last pages, which held only numbers: 1009, 1004,
998, 1001, 1015. Beneath the final column someone had written, in pencil, "It always comes back up."

Ada read the notebook twice, then put it back on the shelf, because it seemed to belong there.

By the end of the first month she had a routine. She left the cottage at seven, walked the path along the cliff while
the gulls argued over the rocks below, climbed the tower, and sat for an hour in the lamp room with a flask of tea and
the logbook the harbour office had given her. She liked the quiet. She liked that the lamp did its work whether or
not anyone was watching, and that her part of the work was small enough to do well.

"Do you get lonely out there?" her brother asked on the phone one evening.

"Not really," she said. "The lamp keeps me company. It has opinions."

"Lamps don't have opinions."

"This one thinks the fog is coming in at four o'clock. It has been right three days running."

He laughed, and she did not explain that the lamp had a fog sensor wired to a horn, and that the sensor was more
reliable than the forecast. Some things are better left as stories.

In October the storms began. The first one arrived faster than the forecast had promised, a wall of grey rain that
swallowed the horizon in twenty minutes. The power line from the mainland failed at 16:42, and the backup generator
started, as it was meant to, eleven seconds later. Ada watched the lamp stutter and then resume its slow turn. She
wrote the times in the logbook, then, after a moment, wrote them in the old notebook too.

---

A short guide to the readings, for whoever keeps the tower next:

1. The barometer is read in hectopascals. Anything below 990 means a serious storm; below 970 is rare and dangerous.
2. The lamp should complete one rotation every 7.5 seconds. If it takes longer than 8 seconds, the motor bearings
   need grease (the tin is in the second drawer, left side).
3. The generator log records hours run. Service it every 250 hours, or every six months, whichever comes first.
4. The fog horn sounds two blasts every thirty seconds. If it sounds one long blast, the sensor has failed; switch
   it to manual and call the office.
5. Never leave the gallery door open in a wind above force six. It will not close again until the wind drops.

---

Questions people ask about lighthouses, with short answers:

Q: Why do lighthouses flash instead of shining steadily?
A: A steady light is easy to confuse with a ship, a house or a street lamp. A pattern of flashes, with a known period,
tells a navigator exactly which lighthouse they are looking at. Charts list each light's pattern.

Q: How far can the light be seen?
A: It depends on the height of the lamp and the curve of the Earth as much as on its brightness. A lamp sixty metres
above the sea can be seen from roughly thirty kilometres away by an observer on the deck of a ship, in clear weather.

Q: Are there still lighthouse keepers?
A: Very few. Most lights were automated in the second half of the twentieth century. The remaining keepers are
mostly caretakers of historic buildings, like the one in this story.

---

The harbour office kept its records in a small program that Ada's predecessor had written. She found the source on a
memory stick taped inside the notebook's back cover, and, being curious, read it on her laptop one rainy afternoon.

    def pressure_trend(readings, window=3):
        \"\"\"Return 'rising', 'falling' or 'steady' from the last few barometer readings.\"\"\"
        if len(readings) < window:
            return "steady"
        recent = readings[-window:]
        change = recent[-1] - recent[0]
        if change > 2:
            return "rising"
        if change < -2:
            return "falling"
        return "steady"


    def needs_service(hours_run, months_since_service):
        return hours_run >= 250 or months_since_service >= 6


    if __name__ == "__main__":
        log = [1012, 1009, 1004, 998, 1001, 1015]
        print(pressure_trend(log))          # rising
        print(needs_service(120, 7))         # True

The program was short and clear, and it did exactly what the guide said. Ada added a test for the case where all the
readings were equal, because the original had none, and felt oddly pleased when it passed.

---

The worst storm came in the second week of January. The barometer fell through the afternoon: 1003 at noon, 991 at
three, 982 by six in the evening. The wind rose until the whole tower hummed, a low note that Ada felt in her teeth
more than she heard it. At 21:15 a call came over the marine radio from a fishing boat, the Curlew, whose engine had
failed two miles to the north. The coastguard answered within a minute, and Ada listened, with the volume turned low,
while they talked the skipper through setting a sea anchor and waiting for the lifeboat.

There was nothing for her to do but keep the light turning, and so she did that. She checked the rotation every ten
minutes (7.5 seconds, 7.5 seconds, 7.6 seconds), wrote each reading down, and watched the beam sweep out across the
rain towards the place where the Curlew would be. At 23:40 the radio said the lifeboat had the boat under tow. At
01:05 it said they were inside the harbour wall. Ada wrote the times in both books and went downstairs to make tea.

In the morning the sky was a pale, rinsed blue, and the barometer read 1004 and rising. Ada climbed to the lamp room,
opened the old notebook to its last page, and under the pencil line that said "It always comes back up" she wrote,
in ink, "Yes. It does." Then she wiped the salt from the lens, because it was Tuesday, and that was the job.

---

Notes on measurement, kept at the back of the logbook:

A reading is only useful if you know how it was taken. Write the time, the instrument and the units every time, even
when they seem obvious. Round only at the end of a calculation, never in the middle. When two instruments disagree,
record both values and the difference between them; do not silently pick the one you prefer. If a value looks wrong,
measure it again before you correct anything, and if the second measurement agrees with the first, believe it.

Averages hide things. A week with a mean pressure of 1005 might have been calm throughout, or it might have held a
storm and a heatwave that cancelled out. Keep the raw readings, and compute the average from them when you need it.
Plot them when you can: a line on a chart shows a trend that a column of numbers hides.

Finally, be honest about what you did not measure. "The gauge was not read on Saturday because the stairs were iced"
is a perfectly good entry. A gap that is explained is a fact; a gap that is filled with a guess is a mistake that
somebody else will have to find.
"""
