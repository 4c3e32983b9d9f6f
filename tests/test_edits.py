"""Rule-made texts from review sentences (classify.text.edits): negation edits, contrast joins, the lexicon."""

import numpy as np
import pytest

from classify.text.edits import Lexicon, contrast_joins, negate, negated, negation_pairs, sentences, whole


def test_negate_inserts_not_after_the_first_copula_or_modal():
    assert negate("The plot was thin.").text == "The plot was not thin."
    assert negate("It's a mess, but a fun one.").text == "It's not a mess, but a fun one."
    assert negate("You will love it!").text == "You will not love it!"
    edit = negate("The acting is wooden, however the music saves it.")
    assert edit.plain == "The acting is wooden, however the music saves it."
    assert edit.scope == ["wooden"]  # the clause's end closes the scope


def test_negate_removes_a_negation_keeping_case_and_punctuation():
    assert negate("It wasn't funny.").text == "It was funny."
    assert negate("Don't miss it.").text == "Do miss it."
    assert negate("It was not funny at all.").text == "It was funny at all."
    assert negate("It was not funny at all.").plain == "It was funny at all."
    assert negate("I \"couldn't\" stop.").text == "I \"could\" stop."


def test_negate_contracts_the_negation_it_puts_in_when_asked():
    assert negate("The plot was thin.", contract=True).text == "The plot wasn't thin."
    assert negate("You will love it!", contract=True).text == "You won't love it!"
    assert negate("Can you believe it?", contract=True).text == "Can't you believe it?"   # case kept
    assert negate("I am bored.", contract=True).text == "I am not bored."                 # no "amn't"
    assert negate("It's fun.", contract=True).text == "It's not fun."


VERBS = frozenset({"love", "deserve", "like", "watch", "try", "stop"})


def test_negate_gives_a_lexical_verb_after_a_pronoun_do_support():
    assert negate("I loved this movie.", VERBS).text == "I did not love this movie."
    assert negate("It deserves better.", VERBS).text == "It does not deserve better."
    assert negate("They watch it every year.", VERBS).text == "They do not watch it every year."
    assert negate("I really liked the cast.", VERBS, contract=True).text == "I didn't really like the cast."
    assert negate("He tried hard.", VERBS).text == "He did not try hard."
    assert negate("I thought it was great.", VERBS).text == "I did not think it was great."   # irregular
    edit = negate("We stopped watching, and it got better.", VERBS)
    assert edit.text == "We did not stop watching, and it got better." and edit.scope == ["stopped", "watching"]
    # Only a verb the lexicon knows, after the sentence's own subject; otherwise the copula rule reads on.
    assert negate("I hoped it was good.", VERBS).text == "I hoped it was not good."
    assert negate("Then I loved it.", VERBS) is None
    assert negate("I loved this movie.") is None          # no verbs given: copulas and modals only
    assert negate("It does work.", VERBS) is None         # an auxiliary is not a lexical verb


def test_negate_leaves_what_the_rule_cannot_read():
    assert negate("I never laughed once.") is None        # a negation with no verb to undo
    assert negate("Nothing happens here.") is None
    assert negate("Watch it tonight.") is None             # no copula or modal
    assert negate("The ending is, frankly, silly.") is None
    assert negate("The film was never dull.").text == "The film was dull."   # "never" after a copula comes out


def test_negate_writes_never_and_no_where_people_do_when_asked():
    # A draw under the share writes the rarer form, over it "not" as before; "no" takes an article's place.
    assert negate("It is a gem.", negators="varied", draw=0.5).text == "It is no gem."
    assert negate("It is a gem.", negators="varied", draw=0.7).text == "It is not a gem."
    assert negate("It's an epic.", negators="varied", draw=0.1).text == "It's no epic."
    assert negate("The plot was dull.", negators="varied", draw=0.01).text == "The plot was never dull."
    assert negate("The plot was dull.", negators="varied", draw=0.5).text == "The plot was not dull."
    assert negate("I enjoyed it.", VERBS | {"enjoy"}, negators="never", draw=0.05).text == "I never enjoyed it."
    assert (negate("I really liked the cast.", VERBS, negators="never", draw=0.05).text
            == "I never really liked the cast.")
    assert negate("I liked the cast.", VERBS, negators="never", draw=0.5).text == "I did not like the cast."
    edit = negate("It is a gem.", negators="varied", draw=0.5)
    assert edit.plain == "It is a gem." and edit.scope == ["a", "gem"]
    # "never" writes no "no".
    assert negate("It is a gem.", negators="never", draw=0.01).text == "It is not a gem."
    # ... and takes out what it writes, as "not" is taken out.
    edit = negate("It was no gem.", negators="varied")
    assert edit.text == edit.plain == "It was a gem." and edit.scope == ["a", "gem"]
    assert negate("There was no art in it.", negators="varied").text == "There was an art in it."
    assert negate("I never liked it.", VERBS, negators="never").text == "I liked it."
    assert negate("It was no gem.", negators="never") is None
    # "no" that negates no article is left alone, and with "not" neither form is read or written.
    assert negate("It was no longer fun.", negators="varied") is None
    assert negate("It was no gem.") is None and negate("I never liked it.", VERBS) is None
    assert negate("It is a gem.", draw=0.0).text == "It is not a gem."


def test_sentences_and_negated():
    assert sentences("Great cast. Awful script! Why?") == ["Great cast.", "Awful script!", "Why?"]
    assert negated("It isn't good.") and negated("Not bad.") and not negated("A good time.")


def test_the_lexicon_reads_polar_words_and_ignores_negators():
    texts = ["a superb film", "superb and moving", "not a dull moment", "a dull mess", "dull and not moving",
             "a superb mess"]
    lexicon = Lexicon.fit(texts, [1, 1, 1, 0, 0, 0], min_count=1)
    assert lexicon.ratio["superb"] > 0 > lexicon.ratio["dull"]
    # "superb": 2 of 3 positive texts, 1 of 3 negative ones, each text counted once; add-one smoothed
    assert lexicon.ratio["superb"] == pytest.approx(np.log(3 / 4) - np.log(2 / 4))
    assert lexicon.score("not superb") == lexicon.score("superb")  # "not" is no evidence either way


def test_the_lexicon_learns_verbs_from_what_follows_a_negated_do():
    texts = ["I didn't enjoy it, I enjoyed nothing and stopped enjoying it.", "You don't want the ending.",
             "Did not watch it, then I watched it, watching it twice.", "They didn't really try."]
    lexicon = Lexicon.fit(texts, [0, 0, 1, 1], min_count=1)
    # "enjoy" and "watch" show their past and -ing forms; "the" and "really" follow a negated "do" but are no
    # verbs, nor is "want" here (no "wanted", no "wanting"), nor "try" (no "tried").
    assert lexicon.verbs == {"enjoy", "watch"}


def test_negation_pairs_flip_the_label_of_polar_sentences_only():
    lexicon = Lexicon({"wonderful": 2.0, "dreadful": -2.0, "film": 0.0})
    reviews = ["I went on a Sunday. The film was wonderful from start to end. Was it wonderful?",
               "The film wasn't dreadful at all, I must say.",
               "The film was dreadful in every way.",
               "The cinema was cold and I was late today."]   # nothing polar: no pair
    texts, labels = negation_pairs(reviews, [1, 1, 0, 0], lexicon)
    assert texts[0::2] == ["The film was wonderful from start to end.", "The film wasn't dreadful at all, I must say.",
                           "The film was dreadful in every way."]
    assert texts[3] == "The film was dreadful at all, I must say."
    # A negation put in is contracted or not, at random (people write both).
    assert texts[1] in ("The film was not wonderful from start to end.", "The film wasn't wonderful from start to end.")
    assert texts[5] in ("The film was not dreadful in every way.", "The film wasn't dreadful in every way.")
    many = negation_pairs(["The film was wonderful from start to end."] * 40, [1] * 40, lexicon)[0]
    assert set(many[1::2]) == {"The film was not wonderful from start to end.",
                               "The film wasn't wonderful from start to end."}
    assert labels == [1, 0, 1, 0, 0, 1]
    # A contrast after the negated clause has a say in the label: left out.
    assert negation_pairs(["The film was wonderful, but the end drags on."], [1], lexicon) == ([], [])
    # A sentence whose polar words disagree with its review's label is no evidence for it: left out.
    assert negation_pairs(["The film was wonderful from start to end."], [0], lexicon) == ([], [])


def test_negation_pairs_write_never_and_no_under_flipped_labels_when_asked():
    lexicon = Lexicon({"gem": 2.0, "dull": -2.0, "film": 0.0})
    reviews = ["The film is a gem.", "The film was dull."] * 200
    texts, labels = negation_pairs(reviews, [1, 0] * 200, lexicon, negators="varied")
    edits = texts[1::2]
    assert labels == [1, 0, 0, 1] * 200
    assert set(edits[0::2]) == {"The film is no gem.", "The film is not a gem.", "The film isn't a gem."}
    assert set(edits[1::2]) == {"The film was never dull.", "The film was not dull.", "The film wasn't dull."}
    # Near the measured shares: "no" for most indefinite predicates, "never" for a few others.
    assert 0.45 < edits[0::2].count("The film is no gem.") / 200 < 0.75
    assert 0 < edits[1::2].count("The film was never dull.") / 200 < 0.15
    never = negation_pairs(reviews, [1, 0] * 200, lexicon, negators="never")[0]
    assert "never" in " ".join(never) and " no " not in " ".join(never)
    assert not {"never", "no"} & set(" ".join(negation_pairs(reviews, [1, 0] * 200, lexicon)[0]).split())


def test_whole_sentences_stand_on_their_own():
    assert whole("The cast is superb.")
    assert not whole("But the cast is superb.")          # leans on the sentence before
    assert not whole("the cast is superb.")              # cut mid-sentence
    assert not whole("I loved Goodnight Mr.")            # cut at a title's dot


def test_contrast_joins_pair_opposite_sentences_both_ways_labelled_by_the_second():
    lexicon = Lexicon({"superb": 3.0, "dreadful": -3.0})
    reviews = ["I saw it twice. The cast is superb!", "The script is dreadful.", "The film is dreadful. Why?",
               "But it is superb."]   # no whole polar sentence in the last: it draws nothing
    texts, labels = contrast_joins(reviews, [1, 0, 0, 1], lexicon)
    assert len(texts) == 2 and labels == [0, 1]   # one positive sentence drawn: one pair, both ways round
    first, second = texts
    assert first.startswith("The cast is superb, but the ") and first.endswith(" is dreadful.")
    assert second.startswith("The ") and second.endswith(" is dreadful, but the cast is superb!")
    assert contrast_joins(reviews, [1, 0, 0, 1], lexicon, seed=1)[1] == [0, 1]
